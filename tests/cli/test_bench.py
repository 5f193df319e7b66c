"""`rlt bench` on tiny checkpoints, in-process through typer's CliRunner: --json, table, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_checkpoints
from typer.testing import CliRunner, Result

from rlt_cli.main import app

CPU = ("--dtype", "float32", "--device", "cpu", "--num-blocks", "256")
TINY = ("--prompt-len", "4", "--output-len", "4", "--repeats", "1", "--warmup", "0")
DEPTH = 4  # total_ut_steps of the tiny Ouro
METRICS = ("decode_tokens_per_s", "ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "e2e_ms_p50")


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, ["bench", *args])


def run_tiny(model_dir: Path, *args: str) -> Result:
    return invoke("--model", str(model_dir), *CPU, *TINY, *args)


def run_json(model_dir: Path, *args: str) -> dict:
    result = run_tiny(model_dir, "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # stdout holds the JSON object and nothing else


def assert_one_error_line(result: Result, *needles: str) -> None:
    assert result.exit_code not in (0, None), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_json_reports_every_concurrency(tiny_ouro_dir: Path) -> None:
    data = run_json(tiny_ouro_dir, "--concurrency", "1", "--concurrency", "2")
    assert data["num_loops"] == DEPTH and data["model"] == str(tiny_ouro_dir)
    assert (data["prompt_len"], data["output_len"], data["exit_threshold"]) == (4, 4, 1.0)
    assert [r["concurrency"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        for key in METRICS:
            assert isinstance(r[key], float) and r[key] > 0, key
        assert r["ttft_ms_p90"] >= r["ttft_ms_p50"]
        assert len(r["decode_tokens_per_s_all"]) == 1
        # fixed depth by default: every output token of every request ran all loops
        assert r["exit_depths"] == {"1": 0, "2": 0, "3": 0, "4": 4 * r["concurrency"]}


def test_loop_controls_reach_the_requests(tiny_ouro_dir: Path) -> None:
    capped = run_json(tiny_ouro_dir, "-c", "1", "--max-loops", "2")["results"][0]
    # the first token comes from full-depth prefill; decode tokens stop at --max-loops
    assert capped["exit_depths"] == {"1": 0, "2": 3, "3": 0, "4": 1}
    adaptive = run_json(tiny_ouro_dir, "-c", "2", "--exit-threshold", "0.5")["results"][0]
    assert sum(adaptive["exit_depths"].values()) == 8


def test_works_without_a_tokenizer(tmp_path: Path) -> None:
    model_dir = tiny_checkpoints.write_tiny_ouro(tmp_path, tokenizer_from=None)
    data = run_json(model_dir, "-c", "1")
    assert data["results"][0]["decode_tokens_per_s"] > 0


def test_human_table(tiny_ouro_dir: Path) -> None:
    result = run_tiny(tiny_ouro_dir, "-c", "1", "-c", "2")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "tok/s" in out and "TTFT p50" in out and "TPOT p50" in out and "E2E p50" in out
    header = next(line for line in out.splitlines() if "concurrency" in line)
    assert header.split()[-DEPTH:] == [f"d{d}" for d in range(1, DEPTH + 1)]
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [row[0] for row in rows] == ["1", "2"]
    assert [row[-DEPTH:] for row in rows] == [["0", "0", "0", "4"], ["0", "0", "0", "8"]]
    assert "fixed depth 4" in out


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("--output-len", "1"), ("--output-len must be >= 2",)),
        (("--prompt-len", "0"), ("--prompt-len must be >= 1",)),
        (("--repeats", "0"), ("--repeats must be >= 1",)),
        (("--warmup", "-1"), ("--warmup must be >= 0",)),
        (("--concurrency", "0"), ("--concurrency must be >= 1",)),
        (("--concurrency", "9", "--max-num-seqs", "8"), ("exceeds --max-num-seqs 8",)),
        (("--exit-threshold", "1.5"), ("exit_threshold",)),
        (("--min-loops", "3", "--max-loops", "2"), ("min_loops (3) must be <= max_loops (2)",)),
        (("--concurrency", "two"), ("--concurrency", "rlt bench --help")),
        (("--no-such-flag",), ("--no-such-flag",)),
        (("--dtype", "float8"), ("float8",)),
    ],
)
def test_bad_values_fail_with_one_line(tiny_ouro_dir: Path, args: tuple, needles: tuple) -> None:
    assert_one_error_line(run_tiny(tiny_ouro_dir, *args), *needles)


def test_errors_after_loading_are_one_line_too(tiny_ouro_dir: Path) -> None:
    assert_one_error_line(run_tiny(tiny_ouro_dir, "--max-loops", "9"), "model depth (4)")
    assert_one_error_line(run_tiny(tiny_ouro_dir, "--prompt-len", "100000"), "context")
    assert_one_error_line(invoke("--model", "/no/such/model", *CPU, *TINY))
