"""`rlt eval gsm8k` end to end on the bundled demo model (CPU, offline, the checked-in fixture):
in-process and through a loopback `rlt serve`, with identical answers both ways; --resume;
--json; and every bad flag as one line before any model loads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from rlt_cli.main import app

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "gsm8k"
DATA = ("--data", str(FIXTURES / "test.jsonl"))
# 20 questions, two settings; short answers keep it quick on two CPU cores
SWEEP = ("gsm8k", *DATA, "--limit", "20", "--loops", "1,2", "--max-tokens", "32")
DEMO = ("--model", "demo", "--dtype", "float32", "--device", "cpu")
COMPARED = ("index", "prompt", "output", "answers", "correct", "num_tokens", "exit_depths")


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, ["eval", *args])


def records(directory: Path) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for path in sorted(directory.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        picked = [{k: r[k] for k in COMPARED} for r in rows]
        out[path.name] = sorted(picked, key=lambda r: r["index"])
    return out


def assert_one_error_line(result: Result, *needles: str) -> None:
    assert result.exit_code not in (0, None), result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def in_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("eval-in-process") / "run"
    result = invoke(*SWEEP, *DEMO, "--output-dir", str(out), "--json")
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


def test_in_process_sweep(in_process: tuple[Path, dict[str, Any]]) -> None:
    out, summary = in_process
    assert summary["task"] == "gsm8k_cot" and summary["num_fewshot"] == 3
    assert summary["questions"] == 20 and summary["max_tokens"] == 32
    assert summary["interval"] == "95% Wilson score interval"
    labels = [s["label"] for s in summary["settings"]]
    assert labels == ["loops=1 exit=default", "loops=2 exit=default"]
    for setting, loops in zip(summary["settings"], (1, 2), strict=True):
        assert setting["questions"] == 20 and setting["max_loops"] == loops
        for name in ("strict-match", "flexible-extract"):
            acc = setting["accuracy"][name]
            assert acc["accuracy"] == acc["correct"] / 20
            assert acc["ci95"][0] <= acc["accuracy"] <= acc["ci95"][1]
        # every token but the first (sampled by the full-depth prefill) runs `loops` loops
        assert loops <= setting["mean_loops_per_token"] < loops + 0.2
        assert setting["output_tokens_per_s"] > 0
    rows = records(out)
    assert sorted(rows) == [f"gsm8k_cot-loops{n}-exitdefault.jsonl" for n in (1, 2)]
    for rows_of_setting in rows.values():
        assert [r["index"] for r in rows_of_setting] == list(range(20))
        first = rows_of_setting[0]
        assert first["prompt"] == (FIXTURES / "gsm8k_cot-3shot-test0.txt").read_text()
        assert len(first["exit_depths"]) == first["num_tokens"] > 0
    assert json.loads((out / "summary.json").read_text())["settings"] == summary["settings"]
    assert json.loads((out / "run.json").read_text())["task"] == "gsm8k_cot"


def test_server_gives_identical_answers(
    in_process: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "server"))
    from server_process import DEMO_ARGS, ServerProcess

    server = ServerProcess(
        *DEMO_ARGS, "--enable-prefix-caching", env={"OMP_NUM_THREADS": "1"}
    ).wait_healthy()
    try:
        result = invoke(*SWEEP, "--url", server.url, "--output-dir", str(tmp_path), "--json")
    finally:
        server.stop()
    assert result.exit_code == 0, result.output
    out, in_process_summary = in_process
    assert records(tmp_path) == records(out)
    summary = json.loads(result.stdout)
    assert summary["url"] == server.url and summary["model"] == f"{server.url} (demo)"
    for served, local in zip(summary["settings"], in_process_summary["settings"], strict=True):
        assert served["accuracy"] == local["accuracy"]
        assert served["mean_loops_per_token"] == local["mean_loops_per_token"]


def test_resume_continues_an_interrupted_run(
    in_process: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    out, summary = in_process
    run = tmp_path / "run"
    shutil.copytree(out, run)
    path = run / "gsm8k_cot-loops2-exitdefault.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:16]) + lines[16][:40])  # killed while writing the 17th
    result = invoke(*SWEEP, *DEMO, "--output-dir", str(run), "--resume", "--json")
    assert result.exit_code == 0, result.output
    assert records(run) == records(out)
    resumed = json.loads(result.stdout)["settings"]
    assert [s["accuracy"] for s in resumed] == [s["accuracy"] for s in summary["settings"]]
    assert resumed[0]["output_tokens_per_s"] is None  # nothing of loops=1 ran this time

    again = invoke(*SWEEP, *DEMO, "--output-dir", str(run))
    assert_one_error_line(again, "already holds run.json: pass --resume")
    other = invoke(*SWEEP, *DEMO, "--output-dir", str(run), "--resume", "--max-tokens", "8")
    assert_one_error_line(other, "written with --max-tokens 32, this run has --max-tokens 8")


def test_human_output_is_a_table() -> None:
    result = invoke("gsm8k", *DATA, "--limit", "2", "--max-tokens", "4", *DEMO)
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())  # the table wraps at the runner's 80 columns
    for needle in ("strict-match", "flexible-extract", "[95% CI]", "loops=default", "Wilson"):
        assert needle in text, result.stdout
    # off a terminal there is no live view, only one line per finished setting on stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("loops=default exit=default: 2/2 questions, strict-match ")
    assert "4.00 loops/token" in line and line.endswith(" tok/s")


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("nope",), ("unknown benchmark 'nope'",)),
        (("gsm8k", "--task", "mmlu"), ("unknown task 'mmlu'", "gsm8k_cot")),
        (("gsm8k", "--loops", "0"), ("--loops 0: loop depths must be >= 1",)),
        (("gsm8k", "--loops", "2,x"), ("--loops 2,x: expected comma-separated numbers",)),
        (("gsm8k", "--loops", "2,2"), ("a value is repeated",)),
        (("gsm8k", "--exit-threshold", "0.5,1.5"), ("exit thresholds must lie in [0, 1]",)),
        (("gsm8k", "--limit", "0"), ("--limit must be >= 1",)),
        (("gsm8k", "--max-tokens", "0"), ("--max-tokens must be >= 1",)),
        (("gsm8k", "--temperature", "-1"), ("--temperature must be >= 0",)),
        (("gsm8k", "--resume"), ("--resume continues the run in --output-dir",)),
        (("gsm8k", "--api-key", "k"), ("--api-key goes with --url",)),
        (("gsm8k", "--url", "http://x", "--block-size", "32"), ("--block-size does not apply",)),
        (("gsm8k", *DATA, "--num-fewshot", "9"), ("--num-fewshot must lie in [0, 8]",)),
        (("gsm8k", *DATA, "--limit", "21"), ("--limit 21: the data has 20 problems",)),
        (("gsm8k", "--data", "/nonexistent.jsonl"), ("--data /nonexistent.jsonl: cannot read",)),
        (("gsm8k", *DATA, "--task", "gsm8k"), ("also pass --fewshot-data TRAIN.jsonl",)),
        (("gsm8k", *DATA, "--kv-layout", "bogus"), ("bogus",)),
        (("gsm8k", "--bogus-flag"), ("No such option: --bogus-flag",)),
        (("gsm8k", *DATA, "--url", "http://127.0.0.1:9"), ("GET http://127.0.0.1:9/v1/models",)),
    ],
)
def test_bad_flags_are_one_line(args: tuple[str, ...], needles: tuple[str, ...]) -> None:
    assert_one_error_line(invoke(*args), *needles)


def test_loops_deeper_than_the_model() -> None:
    assert_one_error_line(
        invoke("gsm8k", *DATA, "--limit", "1", "--loops", "5", *DEMO),
        "--loops 5: the model runs at most 4 loops",
    )


def test_offline_without_data_says_to_pass_data(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("datasets")

    def offline(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)")

    module.load_dataset = offline  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", module)
    assert_one_error_line(invoke("gsm8k", *DEMO), "openai/gsm8k", "pass --data FILE.jsonl")
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    assert_one_error_line(invoke("gsm8k"), "pip install datasets", "pass --data FILE.jsonl")


def test_plot_without_matplotlib_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert_one_error_line(
        invoke("gsm8k", *DATA, "--plot", "out.png"), "--plot needs matplotlib", "rlt[plot]"
    )


def test_the_installed_command_in_a_subprocess() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    command = [sys.executable, "-m", "rlt_cli.main", "eval", "gsm8k", "--loops", "-1"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == ["error: --loops -1: loop depths must be >= 1"]
    help_text = subprocess.run(
        [*command[:5], "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert help_text.returncode == 0 and "--exit-threshold" in help_text.stdout
    assert "--kv-cache-memory" in help_text.stdout  # every engine flag of rlt generate


def test_data_and_prompts_are_checked_without_torch() -> None:
    """Flags, data and prompts fail fast: nothing before the model imports torch."""
    code = (
        "import sys\n"
        "from rlt_cli.main import app\n"
        "try:\n"
        f"    app(['eval', 'gsm8k', '--data', {str(FIXTURES / 'test.jsonl')!r}, '--num-fewshot', "
        "'9'], prog_name='rlt')\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, 'torch' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.split() == ["1", "False"], result.stderr
    assert "--num-fewshot must lie in [0, 8]" in result.stderr
