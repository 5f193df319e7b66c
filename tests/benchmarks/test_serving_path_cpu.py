"""benchmarks/serving_path_cpu.py: the API server's own path (events thread, event loop, SSE
rendering) against a scripted engine process, run for real on tiny runs: this checks the
script and its accounting, not speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "serving_path_cpu.py"


def _run(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_every_request_streams_its_tokens_one_chunk_a_step():
    out = _run("-c", "2,4", "--num-prompts", "6", "--output-len", "8", "--tokens-per-step",
               "2", "--repeat", "2", "--token-rate", "400")  # fmt: skip
    rows = out["rows"]
    assert [r["concurrency"] for r in rows] == [2, 4]
    for row in rows:
        assert row["requests"] == 6 and row["tokens"] == 6 * 8
        # 4 steps of 2 tokens a request, each its own chunk at this slow rate (a server behind
        # would merge them: fewer chunks), then [DONE]
        assert row["chunks_per_token"] == (4 + 1) / 8
        assert len(row["event_loop_us_per_token_runs"]) == 2 and len(row["gc"]) == 2
        assert row["event_loop_us_per_token"] >= 0 and row["other_threads_us_per_token"] >= 0
        for pauses in row["gc"]:
            assert set(pauses) == {"gen0", "gen1", "gen2"}


def test_both_collector_settings_run():
    for setting in ("rlt", "default"):
        out = _run("-c", "2", "--num-prompts", "2", "--output-len", "4", "--repeat", "1",
                   "--token-rate", "400", "--python-gc", setting)  # fmt: skip
        assert out["args"]["python_gc"] == setting and out["rows"][0]["requests"] == 2


def test_http_runs_the_real_app_behind_a_socket():
    """--http: the same core behind rlt serve's app and uvicorn, driven by `rlt bench --url`."""
    out = _run("-c", "2", "--num-prompts", "4", "--output-len", "4", "--repeat", "1",
               "--token-rate", "400", "--http")  # fmt: skip
    row = out["rows"][0]
    assert row["requests"] == 4 and row["tokens"] == 16 and row["failed"] == 0
    assert row["chunks_per_token"] == 0.5  # 2 tokens a step, a chunk each (the client's count)
    assert row["ttft_ms_p50"] > 0 and row["event_loop_us_per_token"] >= 0
    assert set(row["gc"][0]) == {"gen0", "gen1", "gen2"}


def test_http_refuses_settings_rlt_serve_does_not_have():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--http", "--python-gc", "default"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2 and "--http runs rlt serve's own app" in done.stderr
