"""benchmarks/bench_serving_inprocess.py: the serving workload against the AsyncEngine without
HTTP, run for real on the CPU with the demo model (tiny runs: this checks the script, not speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_serving_inprocess.py"
DEMO = ["--model", "demo", "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "4"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.parametrize("where", [[], ["--engine-process"]], ids=["thread", "process"])
def test_closed_loop_and_poisson_runs_report_every_request(where: list[str]):
    runs = ("--warmup", "1", "--runs", "c2:3,r50:2", "--output-len", "3", "--json")
    done = _run(*DEMO, *where, *runs)
    assert done.returncode == 0, done.stderr
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["run"] for r in reports] == ["c2", "r50"]
    for report, n in zip(reports, (3, 2), strict=True):
        assert (report["completed"], report["failed"]) == (n, 0)
        assert report["total_output_tokens"] == 3 * n  # ignore_eos: every token is produced
        assert report["total_input_tokens"] == 64 * n
        assert report["ttft_ms"]["median"] > 0 and report["tpot_ms"]["median"] > 0


def test_a_malformed_run_is_a_usage_error_naming_the_flag():
    done = _run(*DEMO, "--runs", "x8:64")
    assert done.returncode == 2
    assert "--runs" in done.stderr and "cC:N or rR:N" in done.stderr
