"""What a new user hits first (issue 10): broken checkpoints, prompt input, error style.

Most checks run the real entry point in a subprocess (`python -m rlt_cli.main`), since the point
is what a user sees on a terminal: one `error:` line, no traceback, no boxed panel, the flag name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_checkpoints
import torch

from rlt_engine.checkpoints.loader import load_model
from rlt_engine.models.configs import CheckpointError, ConfigError

ROOT = Path(__file__).resolve().parents[2]
CPU = ("--device", "cpu", "--dtype", "float32", "--num-blocks", "256")
BOX = set("╭╮╰╯│─")


def rlt(*args: str, stdin: str | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "rlt_cli.main", *args],
        cwd=ROOT,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line(result: subprocess.CompletedProcess, *needles: str) -> str:
    """A non-zero exit, nothing on stdout, one `error:` line on stderr holding every needle."""
    assert result.returncode not in (0, None), result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert not BOX & set(result.stderr), result.stderr  # no rich panel
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def ids_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Ouro checkpoint without a tokenizer (token-id prompts only)."""
    out = tmp_path_factory.mktemp("tiny-ids")
    return tiny_checkpoints.write_tiny_ouro(out, tokenizer_from=None)


def _broken_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# -- item 1: every checkpoint problem is one line naming the file ---------------------------
def _truncate(path: Path) -> None:
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _garbage_header(path: Path) -> None:
    (path / "model.safetensors").write_bytes(b"\xff" * 8 + b"not a header")


def _config_list(path: Path) -> None:
    (path / "config.json").write_text("[1, 2, 3]")


def _config_wrong_type(path: Path) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw["hidden_size"] = "big"
    (path / "config.json").write_text(json.dumps(raw))


BREAKAGES = {
    "truncated": (_truncate, ("model.safetensors",)),
    "garbage-header": (_garbage_header, ("model.safetensors",)),
    "config-list": (_config_list, ("config.json", "list")),
    "config-wrong-type": (_config_wrong_type, ("config.json", "hidden_size", "'big'")),
}


@pytest.mark.parametrize("kind", BREAKAGES)
def test_broken_checkpoint_raises_checkpoint_error(tmp_path: Path, ids_dir: Path, kind: str):
    breakage, needles = BREAKAGES[kind]
    broken = _broken_copy(ids_dir, tmp_path / kind)
    breakage(broken)
    with pytest.raises(CheckpointError) as info:
        load_model(broken, dtype=torch.float32)
    message = str(info.value)
    assert "\n" not in message
    for needle in (str(broken), *needles):
        assert needle in message, message
    if kind.startswith("config"):
        assert isinstance(info.value, ConfigError)


@pytest.mark.parametrize("kind", ["truncated", "config-wrong-type"])
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_broken_checkpoint_is_one_cli_line(tmp_path: Path, ids_dir: Path, kind: str, command: str):
    breakage, needles = BREAKAGES[kind]
    broken = _broken_copy(ids_dir, tmp_path / kind)
    breakage(broken)
    args = ("hello",) if command == "generate" else ("-c", "1", "--output-len", "2")
    assert_one_line(rlt(command, "--model", str(broken), *CPU, *args), *needles)


def test_garbage_tokenizer_is_an_error_not_no_tokenizer(tmp_path: Path, ids_dir: Path) -> None:
    from rlt_engine import LLM
    from rlt_engine.models.tokenizer import TokenizerError

    broken = _broken_copy(ids_dir, tmp_path / "bad-tokenizer")
    (broken / "tokenizer.json").write_text("{ not json")
    (broken / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    with pytest.raises(TokenizerError, match="cannot load the tokenizer"):
        LLM(str(broken), device="cpu", dtype="float32", num_blocks=64)


# -- item 4: what needs no model is checked before the model loads --------------------------
def test_empty_prompt_fails_before_the_model_loads() -> None:
    # The model directory does not exist: had it been resolved first, that would be the error.
    assert_one_line(rlt("generate", "--model", "/no/such/model", ""), "prompt 1 is empty")
    result = rlt("generate", "--model", "/no/such/model", "-", stdin="")
    assert_one_line(result, "stdin", "empty")


# -- item 5: prompts from stdin and from a file ---------------------------------------------
def _prompts_of(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr
    return [o["prompt"] for o in json.loads(result.stdout)["outputs"]]


def test_prompt_from_stdin(tiny_ouro_dir: Path) -> None:
    long = "The cat sat on the mat. " * 250  # ~1750 tokens, most of the tiny context
    cpu = ("--device", "cpu", "--dtype", "float32")  # the default pool holds a full context
    args = ("generate", "--model", str(tiny_ouro_dir), *cpu, "--max-tokens", "2", "--json")
    result = rlt(*args, "-", "Hello", stdin=long + "\n")
    prompts = _prompts_of(result)
    assert prompts == [long, "Hello"]  # the trailing newline of stdin is not part of the prompt


def test_prompt_file_lines_and_jsonl(tmp_path: Path, tiny_ouro_dir: Path) -> None:
    lines = tmp_path / "prompts.txt"
    lines.write_text("first prompt\n\nsecond prompt\n")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(json.dumps({"prompt": "one\nwith a newline"}) + "\n" + '{"prompt": "two"}\n')
    args = ("generate", "--model", str(tiny_ouro_dir), *CPU, "--max-tokens", "2", "--json")
    assert _prompts_of(rlt(*args, "--prompt-file", str(lines))) == [
        "first prompt",
        "second prompt",
    ]
    both = rlt(*args, "zero", "--prompt-file", str(jsonl))
    assert _prompts_of(both) == ["zero", "one\nwith a newline", "two"]
    assert _prompts_of(rlt(*args, "--prompt-file", "-", stdin="from stdin\n")) == ["from stdin"]


def test_bad_prompt_files_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    assert_one_line(rlt("generate", "--prompt-file", str(bad)), "line 2", '"prompt"')
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert_one_line(rlt("generate", "--prompt-file", str(empty)), "no prompt")
    missing = tmp_path / "missing.txt"
    assert_one_line(rlt("generate", "--prompt-file", str(missing)), "--prompt-file", "missing.txt")
    assert_one_line(rlt("generate"), "no prompt given", "--prompt-file")


# -- item 6: one style, flag names, JSON failures -------------------------------------------
@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("--bad-flag",), ("--bad-flag", "rlt --help")),
        (("genrate",), ("genrate", "generate")),
        (("download",), ("MODEL", "rlt download --help")),
        (("generate", "x", "--min-loops", "3", "--max-loops", "2"), ("--min-loops", "--max-loops")),
        (("generate", "x", "--max-tokens", "0"), ("--max-tokens",)),
        (("bench", "--output-len", "1"), ("--output-len",)),
    ],
)
def test_usage_errors_are_one_line_with_flag_names(args: tuple, needles: tuple) -> None:
    line = assert_one_line(rlt(*args), *needles)
    for field in ("min_loops", "max_loops", "max_tokens", "output_len"):
        assert field not in line, line


def test_advice_names_the_flag_and_never_the_one_already_passed() -> None:
    from rlt_cli.output import flag_message
    from rlt_engine.checkpoints.resolve import ModelNotFoundError, resolve_model_dir

    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_dir("someorg/somemodel-not-downloaded")
    assert "dummy" not in str(info.value)  # no bundled config: dummy would not help
    text = flag_message("or use load_format='dummy' for random weights", ["load_format"], {})
    assert text == "or use --load-format dummy for random weights"


def test_download_json_failure_prints_json() -> None:
    result = rlt("download", "no-such-alias", "--json")
    assert result.returncode == 1
    assert result.stderr == ""
    error = json.loads(result.stdout)
    assert "no-such-alias" in error["error"] and "demo" in error["error"]


# -- item 7: no transformers warning before our own context error ---------------------------
def test_too_long_prompt_is_only_our_error(tmp_path: Path) -> None:
    # the demo tokenizer's model_max_length (2048) equals the model's context
    prompt = tmp_path / "long.txt"
    prompt.write_text("one two three four " * 700 + "\n")
    result = rlt("generate", "--model", "demo", *CPU, "--prompt-file", str(prompt))
    line = assert_one_line(result, "exceeds the model's context", "--max-tokens")
    assert "Token indices" not in result.stderr, line


# -- items 10 and 13: dummy runs of every alias offline, nothing left in the temp dir -------
@pytest.mark.parametrize(
    "alias", ["ouro", "ouro-2.6b", "ouro-thinking", "ouro-2.6b-thinking", "nanbeige"]
)
def test_every_alias_has_a_bundled_config_for_dummy_runs(alias: str, monkeypatch, tmp_path):
    from rlt_engine.checkpoints import resolve
    from rlt_engine.models.configs import load_config

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr("rlt_engine.checkpoints.hub.find_local_copy", lambda *a: None)
    path = resolve.resolve_model_dir(alias, load_format="dummy")
    assert path.parent == resolve.KNOWN_CONFIGS and (path / "config.json").is_file()
    cfg = load_config(path)
    assert cfg.num_layers == {"ouro-2.6b": 48, "ouro-2.6b-thinking": 48, "nanbeige": 22}.get(
        alias, 24
    )
    assert list(tmp_path.iterdir()) == []  # nothing written to the temporary directory
    with pytest.raises(FileNotFoundError) as info:
        resolve.resolve_model_dir(alias)  # not downloaded, no dummy: advise it
    assert "load_format='dummy'" in str(info.value)


def test_help_is_plain_and_h_works() -> None:
    for args in (("-h",), ("generate", "-h"), ("download", "-h")):
        result = rlt(*args)
        assert result.returncode == 0, result.stderr
        for odd in ("<bool>", "<list[str]>", "{PROMPT}", "{model}"):
            assert odd not in result.stdout, (args, odd)
    assert "[PROMPT]..." in rlt("generate", "-h").stdout


def test_interrupted_stream_ends_its_line(capsys) -> None:
    from rlt_cli import output

    output.stream_text("partial text")
    output.end_partial_line()
    output.end_partial_line()  # only once
    assert capsys.readouterr().out == "partial text\n"
