"""`rlt generate` on tiny checkpoints: streaming, summary, --json, --chat, errors, flag mapping.

In-process through typer's CliRunner (the model loads in well under a second once torch is
imported), plus one real subprocess run of the installed entry point's module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_checkpoints
import typer
from typer.testing import CliRunner, Result

from rlt_cli.main import app
from rlt_engine.config import engine_option_names
from rlt_engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
CPU = ("--dtype", "float32", "--device", "cpu", "--num-blocks", "256")
DEMO_WEIGHTS = ROOT / "rlt_engine" / "assets" / "ouro-gsm8k-tiny" / "model.safetensors"
DEPTH = 4  # total_ut_steps of the tiny Ouro


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, ["generate", *args])


def run_tiny(model_dir: Path, *args: str) -> Result:
    return invoke("--model", str(model_dir), *CPU, *args)


def run_json(model_dir: Path, *args: str) -> dict:
    result = run_tiny(model_dir, "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def assert_one_error_line(result: Result, *needles: str) -> None:
    assert result.exit_code not in (0, None), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def tokenizerless_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-ouro-no-tokenizer")
    return tiny_checkpoints.write_tiny_ouro(out, tokenizer_from=None)


# -- human output ---------------------------------------------------------------------------
def test_streams_text_then_summarizes(tiny_ouro_dir: Path) -> None:
    result = run_tiny(tiny_ouro_dir, "Hello world", "--max-tokens", "5", "--ignore-eos")
    assert result.exit_code == 0, result.output
    expected = run_json(tiny_ouro_dir, "Hello world", "--max-tokens", "5", "--ignore-eos")
    text = expected["outputs"][0]["text"]
    assert text and result.stdout == text + "\n"  # the text, and only the text, on stdout
    summary = result.stderr
    assert "exit depth" in summary and "TTFT" in summary and "tok/s" in summary
    header = next(line for line in summary.splitlines() if "prompt" in line)
    assert header.split()[-DEPTH:] == [f"d{d}" for d in range(1, DEPTH + 1)]
    row = next(line for line in summary.splitlines() if line.split()[:1] == ["1"])
    assert row.split()[1:4] == ["2", "5", "length"]  # prompt tokens, output tokens, finish
    assert row.split()[-DEPTH:] == ["0", "0", "0", "5"]  # fixed depth: every token at d4


def test_several_prompts_print_each_completion_in_order(tiny_ouro_dir: Path) -> None:
    prompts = ["Hello world", "The cat sat on the mat"]
    result = run_tiny(tiny_ouro_dir, *prompts, "--max-tokens", "4", "--ignore-eos")
    assert result.exit_code == 0, result.output
    outputs = run_json(tiny_ouro_dir, *prompts, "--max-tokens", "4", "--ignore-eos")["outputs"]
    first = result.stdout.index("[1/2] Hello world")
    second = result.stdout.index("[2/2] The cat sat")
    assert first < result.stdout.index(outputs[0]["text"]) < second
    assert result.stdout.index(outputs[1]["text"], second) > second
    assert any(line.split()[:1] == ["all"] for line in result.stderr.splitlines())


def test_verbose_prints_the_resolved_setup(tiny_ouro_dir: Path) -> None:
    result = run_tiny(tiny_ouro_dir, "Hi", "--max-tokens", "2", "--num-blocks", "7", "-v")
    assert result.exit_code == 0, result.output
    for needle in (str(tiny_ouro_dir), "cpu", "float32", "7 blocks of 16 tokens"):
        assert needle in result.stderr


# -- JSON -----------------------------------------------------------------------------------
def test_json_two_prompts_in_input_order(tiny_ouro_dir: Path) -> None:
    prompts = ["The cat sat on the mat", "Hello world"]
    data = run_json(tiny_ouro_dir, *prompts, "--max-tokens", "5", "--ignore-eos")
    assert data["num_loops"] == DEPTH and len(data["outputs"]) == 2
    singles = [run_json(tiny_ouro_dir, p, "--max-tokens", "5", "--ignore-eos") for p in prompts]
    for prompt, out, single in zip(prompts, data["outputs"], singles, strict=True):
        assert out["prompt"] == prompt
        assert out["prompt_token_ids"] == single["outputs"][0]["prompt_token_ids"]
        assert out["token_ids"] == single["outputs"][0]["token_ids"]
        assert len(out["token_ids"]) == len(out["exit_depths"]) == 5
        assert out["finish_reason"] == "length" and isinstance(out["text"], str)
        assert out["metrics"]["time_to_first_token"] >= 0
        assert set(out) >= {"request_id", "metrics"} and "logprobs" not in out


def test_json_flags_reach_sampling_params(tiny_ouro_dir: Path) -> None:
    data = run_json(tiny_ouro_dir, "Hi", "--max-tokens", "3", "--logprobs", "2", "--seed", "1")
    (out,) = data["outputs"]
    assert len(out["logprobs"]) == len(out["token_ids"])
    assert all(len(lp["top"]) == 2 for lp in out["logprobs"])
    assert "prompt_logprobs" not in out
    scored = run_json(tiny_ouro_dir, "Hi there", "--max-tokens", "1", "--prompt-logprobs", "1")
    (out,) = scored["outputs"]
    prompt_lps = out["prompt_logprobs"]
    assert len(prompt_lps) == len(out["prompt_token_ids"]) and prompt_lps[0] is None
    assert [lp["token_id"] for lp in prompt_lps[1:]] == out["prompt_token_ids"][1:]
    first = data["outputs"][0]["token_ids"][0]
    stopped = run_json(tiny_ouro_dir, "Hi", "--max-tokens", "3", "--stop-token-ids", str(first))
    assert stopped["outputs"][0]["finish_reason"] == "stop"
    assert stopped["outputs"][0]["token_ids"] == [first]


def test_structured_output_flags(tiny_ouro_dir: Path, tmp_path: Path) -> None:
    """--choice, --regex and --json-schema (inline or @FILE) constrain the output."""
    (out,) = run_json(tiny_ouro_dir, "Hi", "--choice", "yes", "--choice", "no")["outputs"]
    assert out["text"] in ("yes", "no") and out["finish_reason"] == "stop"
    (out,) = run_json(tiny_ouro_dir, "Hi", "--regex", "[ab]{3}")["outputs"]
    assert len(out["text"]) == 3 and set(out["text"]) <= {"a", "b"}
    schema = tmp_path / "schema.json"
    schema.write_text(
        '{"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}'
    )
    (out,) = run_json(tiny_ouro_dir, "Hi", "--json-schema", f"@{schema}")["outputs"]
    assert json.loads(out["text"])["k"] in (1, 2)


def test_exit_threshold_records_adaptive_exit_depths(tiny_ouro_dir: Path) -> None:
    args = ("Hello world", "--max-tokens", "5", "--ignore-eos")
    fixed = run_json(tiny_ouro_dir, *args, "--exit-threshold", "1.0")["outputs"][0]
    adaptive = run_json(tiny_ouro_dir, *args, "--exit-threshold", "0.5")["outputs"][0]
    assert fixed["exit_depths"] == [DEPTH] * 5
    depths = adaptive["exit_depths"]
    assert len(depths) == 5 and all(1 <= d <= DEPTH for d in depths)
    assert depths[0] == DEPTH  # the first token comes from full-depth prefill
    assert min(depths) < DEPTH  # this tiny model's gate does exit early at 0.5
    capped = run_json(tiny_ouro_dir, *args, "--exit-threshold", "0.5", "--min-loops", "3")
    assert min(capped["outputs"][0]["exit_depths"]) >= 3


def test_chat_renders_the_template(tiny_ouro_dir: Path) -> None:
    plain = run_json(tiny_ouro_dir, "Hi there", "--max-tokens", "3")["outputs"][0]
    chat = run_json(tiny_ouro_dir, "Hi there", "--max-tokens", "3", "--chat")["outputs"][0]
    assert len(chat["prompt_token_ids"]) > len(plain["prompt_token_ids"])
    assert 1 in chat["prompt_token_ids"]  # <|im_start|>
    result = run_tiny(tiny_ouro_dir, "Hi there", "--max-tokens", "3", "--chat")
    assert result.exit_code == 0 and "exit depth" in result.stderr, result.output


def test_json_stdout_is_only_json(tiny_ouro_dir: Path) -> None:
    result = run_tiny(tiny_ouro_dir, "Hi", "--max-tokens", "2", "--json", "--verbose")
    assert result.exit_code == 0, result.output
    assert len(result.stdout.strip().splitlines()) == 1
    json.loads(result.stdout)


# -- errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--min-loops", "3", "--max-loops", "2"), "--min-loops (3) must be <= --max-loops"),
        (("--max-loops", "99"), "--max-loops"),
        (("--top-p", "0"), "--top-p"),
        (("--temperature", "-1"), "temperature"),
        (("--logprobs", "50"), "logprobs"),
        (("--dtype", "int8"), "dtype"),
        (("--block-size", "0"), "--block-size"),
        (("--max-num-seqs", "8", "--max-num-batched-tokens", "4"), "--max-num-batched-tokens"),
        (("--load-format", "gguf"), "--load-format"),
        (("--device", "nonsense"), "device"),
        (("--max-tokens", "abc"), "--max-tokens"),
        (("--no-such-flag",), "--no-such-flag"),
        (("--stop", ""), "--stop must not hold an empty string"),
        (("--regex", "a", "--choice", "b"), "give one kind of structured output"),
        (("--json-schema", "{bad"), "--json-schema is not JSON"),
        (("--regex", "(("), "the regex does not compile"),
        (("--grammar", "@/no/such/file"), "--grammar: cannot read /no/such/file"),
        (("--max-tokens", "4", "--min-tokens", "9"), "--min-tokens must be an integer in [0, --"),
        (("--max-model-len", "0"), "--max-model-len must be a positive integer, got 0"),
        (("--max-model-len", "9999"), "--max-model-len 9999 exceeds the model's context of 2048"),
        (("--max-model-len", "2", "--max-tokens", "5"), "(5) exceeds --max-model-len 2"),
    ],
)
def test_bad_flags_give_one_line(tiny_ouro_dir: Path, args: tuple[str, ...], needle: str) -> None:
    assert_one_error_line(run_tiny(tiny_ouro_dir, "Hi", "--max-tokens", "2", *args), needle)


def test_missing_prompt_gives_one_line(tiny_ouro_dir: Path) -> None:
    assert_one_error_line(invoke("--model", str(tiny_ouro_dir)), "PROMPT")


def test_cuda_without_cuda_gives_one_line(tiny_ouro_dir: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    result = invoke("Hi", "--model", str(tiny_ouro_dir), "--device", "cuda")
    assert_one_error_line(result, "CUDA")


def test_unknown_model_gives_one_line() -> None:
    assert_one_error_line(invoke("Hi", "--model", "no-such-model", *CPU), "no-such-model")


def test_directory_without_config_gives_one_line(tmp_path: Path) -> None:
    assert_one_error_line(invoke("Hi", "--model", str(tmp_path), *CPU), "config.json")


def test_stop_without_tokenizer_gives_one_line(tokenizerless_dir: Path) -> None:
    assert_one_error_line(run_tiny(tokenizerless_dir, "Hi", "--stop", "."), "--stop", "tokenizer")


def test_chat_without_template_gives_one_line(tiny_nanbeige_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "no-template"
    model.mkdir()
    for path in tiny_nanbeige_dir.iterdir():
        (model / path.name).write_bytes(path.read_bytes())
    config = model / "tokenizer_config.json"
    raw = json.loads(config.read_text())
    raw.pop("chat_template", None)
    config.write_text(json.dumps(raw))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    assert_one_error_line(run_tiny(model, "Hi", "--chat"), "chat template")


def test_engine_errors_derive_from_the_caught_bases() -> None:
    from rlt_cli.output import USER_ERRORS
    from rlt_engine.checkpoints.loader import CheckpointError
    from rlt_engine.checkpoints.resolve import ModelNotFoundError
    from rlt_engine.models.configs import ConfigError
    from rlt_engine.models.tokenizer import TokenizerError

    for error in (ModelNotFoundError, ConfigError, CheckpointError, TokenizerError):
        assert issubclass(error, USER_ERRORS), error


# -- flags <-> Python API -------------------------------------------------------------------
def generate_flags() -> dict[str, object]:
    command = typer.main.get_command(app).commands["generate"]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params}


def test_flags_are_exactly_the_engine_options_and_sampling_fields() -> None:
    from dataclasses import fields

    params = generate_flags()
    sampling = {f.name for f in fields(SamplingParams)} - {"priority", "logit_bias", "structured"}
    front_end = {"prompts", "prompt_file", "chat", "json_output", "verbose"}
    front_end |= {"json_schema", "json_object", "regex", "choice", "grammar"}  # structured
    assert set(params) - front_end == set(engine_option_names()) | sampling
    for name in set(params) - front_end:
        param = params[name]
        assert param.opts[0] == "--" + name.replace("_", "-"), param.opts  # type: ignore[attr-defined]
        assert param.help, f"--{name} has no help text"  # type: ignore[attr-defined]
    assert params["refill"].secondary_opts == ["--no-refill"]  # type: ignore[attr-defined]
    assert params["stop"].multiple and params["stop_token_ids"].multiple  # type: ignore[attr-defined]


def test_no_model_uses_the_default_and_prints_its_notice() -> None:
    from rlt_engine.checkpoints.resolve import DEMO_ALIAS, default_model

    if not DEMO_WEIGHTS.is_file():
        pytest.skip("the bundled demo model is not in the tree yet")
    name, notice = default_model()
    if name != DEMO_ALIAS:
        pytest.skip("a downloaded Ouro would be the default (too big for a CPU test)")
    result = invoke("Hi", "--device", "cpu", "--max-tokens", "3", "--json")
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["outputs"]) == 1
    assert notice is not None and notice in " ".join(result.stderr.split())


# -- one real process -----------------------------------------------------------------------
def test_subprocess_streams_and_summarizes(tiny_ouro_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    args = ["generate", "Hello world", "--model", str(tiny_ouro_dir), *CPU, "--max-tokens", "5"]
    result = subprocess.run(
        [sys.executable, "-m", "rlt_cli.main", *args, "--ignore-eos"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.strip()  # the streamed text
    assert "exit depth" in result.stderr and "length" in result.stderr
