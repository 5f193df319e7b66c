"""The `rlt` Typer app: help, version, planned commands, and a torch-free import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBCOMMANDS = ("download", "generate", "bench", "profile", "serve", "eval", "pd-launch")
PLANNED = SUBCOMMANDS[6:]


def rlt(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    return subprocess.run(
        [sys.executable, "-m", "rlt_cli.main", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_help_lists_every_subcommand() -> None:
    result = rlt("--help")
    assert result.returncode == 0, result.stderr
    assert "Usage: rlt " in result.stdout
    for name in SUBCOMMANDS:
        assert f" {name} " in result.stdout, name


def test_version() -> None:
    from rlt_engine import __version__

    result = rlt("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"rlt {__version__}" == "rlt 0.1.0"


@pytest.mark.parametrize("name", PLANNED)
def test_planned_commands_say_so(name: str) -> None:
    result = rlt(name, "some-arg", "--concurrency", "8", "--spec", "k=2")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"rlt {name} is not implemented yet" in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_planned_command_help_still_works() -> None:
    result = rlt("generate", "--help")
    assert result.returncode == 0 and "Generate text" in result.stdout


def test_importing_the_cli_does_not_import_torch() -> None:
    code = "import sys, rlt_cli.main; assert 'torch' not in sys.modules, 'torch was imported'"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()
