"""`rlt bench --url` against a real `rlt serve` (demo model, CPU, loopback port): the JSON
report's counts, the table, and one-line errors for an unreachable server, a wrong URL or
model, engine flags given with --url and serving flags given without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from rlt_cli.main import app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_process import DEMO_ARGS, ROOT, ServerProcess, free_port

# one intra-op thread: the demo model's kernels are tiny, and spinning threads on a busy
# CI machine only slow them down (see tests/conftest.py)
SERVER_ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(*DEMO_ARGS, env=SERVER_ENV).wait_healthy()
    yield proc
    proc.stop()


def rlt_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlt_cli.main", "bench", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OPENAI_API_KEY": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, ["bench", *args], env={"OPENAI_API_KEY": ""})


def assert_one_error_line(result: Result, *needles: str) -> None:
    assert result.exit_code not in (0, None), result.output
    assert "Traceback" not in result.output and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_json_report_against_a_real_server(server: ServerProcess) -> None:
    args = ("--num-prompts", "12", "--input-len", "8", "--output-len", "6")
    done = rlt_bench("--url", server.url, *args, "--max-concurrency", "4", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # stdout holds the JSON object and nothing else
    assert report["model"] == "demo"  # the first id of /v1/models
    assert (report["completed"], report["failed"], report["errors"]) == (12, 0, {})
    assert report["total_output_tokens"] == 12 * 6
    assert report["total_input_tokens"] == 12 * 8
    assert (report["max_concurrency"], report["request_rate"]) == (4, "inf")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = report[key]
        assert 0 < stats["median"] <= stats["p99"], (key, stats)
    assert report["e2e_ms"]["mean"] > report["ttft_ms"]["mean"]
    assert report["tokens_per_chunk"] >= 1  # rlt serve sends token_ids per chunk
    assert report["output_throughput"] == pytest.approx(72 / report["duration_s"])


def test_table_gsm8k_and_loop_controls(server: ServerProcess, tmp_path: Path) -> None:
    path = tmp_path / "questions.jsonl"
    path.write_text('{"question": "Tom has 3 apples and buys 4 more. How many?"}\n')
    args = ("--dataset", "gsm8k", "--dataset-path", str(path), "--exit-threshold", "0.5")
    result = invoke("--url", server.url + "/v1", *args, "--num-prompts", "3", "--output-len", "4")
    assert result.exit_code == 0, result.output
    out = result.stdout
    for needle in ("TTFT", "TPOT", "ITL", "E2E", "Completed 3, failed 0", "gsm8k questions"):
        assert needle in out, out
    assert "exit_threshold 0.5" in out  # sent as the looped-model extension field


def test_unreachable_server_is_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert_one_error_line(invoke("--url", url, "--num-prompts", "1"), "cannot connect to", url)


def test_wrong_url_and_model_are_one_line(server: ServerProcess) -> None:
    assert_one_error_line(invoke("--url", server.url + "/nope"), "404 Not Found", "base URL")
    assert_one_error_line(
        invoke("--url", server.url, "--model", "nope", "--num-prompts", "1"),
        "test request",
        "the model 'nope' does not exist",
    )


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("--dtype", "float32"), "--dtype"),
        (("--enforce-eager",), "--enforce-eager"),
        (("--max-num-seqs", "4"), "--max-num-seqs"),
        (("-c", "8"), "--concurrency"),
        (("--repeats", "2"), "--repeats"),
    ],
)
def test_engine_flags_with_url_are_one_line(args: tuple[str, ...], flag: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # refused before any connection
    assert_one_error_line(invoke("--url", url, *args), f"{flag} cannot be used with --url")


def test_concurrency_with_url_names_the_serving_flag() -> None:
    """Someone who ran the offline `-c 8` gets the serving benchmark's flag for it."""
    url = f"http://127.0.0.1:{free_port()}"
    assert_one_error_line(invoke("--url", url, "-c", "8"), "--max-concurrency")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--num-prompts", "0"), "--num-prompts must be >= 1"),
        (("--input-len", "0"), "--input-len must be >= 1"),
        (("--request-rate", "0"), "--request-rate must be > 0"),
        (("--max-concurrency", "0"), "--max-concurrency must be >= 1"),
        (("--dataset", "gsm8k"), "--dataset gsm8k needs --dataset-path"),
        (("--dataset", "other"), "--dataset must be one of random, gsm8k"),
    ],
)
def test_bad_serving_values_are_one_line(args: tuple[str, ...], needle: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert_one_error_line(invoke("--url", url, *args), needle)


def test_serving_flags_need_url() -> None:
    assert_one_error_line(invoke("--num-prompts", "5"), "--num-prompts", "give --url")
    assert_one_error_line(invoke("--request-rate", "4"), "--request-rate", "give --url")
