"""benchmarks/serving_host_cpu.py: `rlt serve` on the tiny model driven by `rlt bench --url`,
run for real on the CPU (tiny runs: this checks the script and its accounting, not speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmark_scripts import load

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "serving_host_cpu.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )


def test_runs_report_the_event_loop_and_engine_cpu_per_token():
    done = _run("--tiny", "-c", "2,4", "--num-prompts", "6", "--warmup", "2",
                "--output-len", "4", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    runs = json.loads(done.stdout.splitlines()[-1])["runs"]
    assert [r["concurrency"] for r in runs] == [2, 4]
    for run in runs:
        assert run["failed"] == 0 and run["errors"] == {} and run["num_prompts"] == 6
        assert run["output_tokens_per_s"] > 0 and run["tokens_per_chunk"] >= 1
        # every run serves 24 tokens; /proc counts CPU in 10 ms ticks, so a run this small may
        # read 0 for a side, never less, and the per-token figures are the totals over 24
        assert run["event_loop_cpu_s"] >= 0 and run["other_threads_cpu_s"] >= 0
        assert run["event_loop_us_per_token"] == run["event_loop_cpu_s"] / 24 * 1e6
        assert run["other_threads_us_per_token"] == run["other_threads_cpu_s"] / 24 * 1e6
        assert run["engine_process_us_per_token"] == run["engine_process_cpu_s"] / 24 * 1e6
    # the engine runs in the server's child process: its work is counted there
    assert sum(run["engine_process_cpu_s"] for run in runs) > 0


def test_refused_requests_are_reported_not_only_left_out_of_the_rate():
    done = _run("--tiny", "-c", "4", "--num-prompts", "8", "--warmup", "1", "--output-len",
                "4", "--serve-arg=--max-concurrent-requests", "--serve-arg=1")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "failed" in done.stdout.splitlines()[-1]
    refused = [line for line in done.stderr.splitlines() if "HTTP 429" in line]
    assert refused and refused[0].startswith("c=4: ")
    assert int(refused[0].split()[1]) > 0


def test_a_server_that_cannot_start_is_one_line_not_a_hang():
    done = _run("--tiny", "-c", "1", "--serve-arg=--no-such-flag")
    assert done.returncode != 0
    assert "the server exited with" in done.stderr


def test_thread_cpu_splits_the_main_thread_from_the_others(tmp_path):
    script = load("serving_host_cpu")
    main, others = script.thread_cpu(os.getpid())
    assert main > 0 and others >= 0
    model = script.tiny_model(tmp_path / "tiny")
    names = {p.name for p in model.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names


def test_children_cpu_counts_the_child_processes(tmp_path):
    script = load("serving_host_cpu")
    busy = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.process_time()\n"
         "while time.process_time() - t < 0.3: pass\nprint(1, flush=True)\ntime.sleep(30)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert busy.stdout is not None and busy.stdout.readline().strip() == "1"
        assert script.children_cpu(os.getpid()) >= 0.25
    finally:
        busy.kill()
        busy.wait()
