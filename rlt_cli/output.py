"""Shared console output: rich for people, one red line for errors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

stdout = Console(highlight=False, soft_wrap=True)
stderr = Console(stderr=True, highlight=False, soft_wrap=True)

# What a command turns into one readable line. Every model/config/checkpoint/tokenizer error
# of the engine derives from one of these (ModelNotFoundError is a FileNotFoundError;
# ConfigError, CheckpointError and TokenizerError are ValueErrors; tests/cli/test_generate.py
# checks it), so the torch-importing modules that define them need not be imported just to
# print a flag error.
USER_ERRORS = (ValueError, FileNotFoundError)


def one_line(text: str) -> str:
    return " ".join(text.split())


def fail(message: str, code: int = 1) -> NoReturn:
    """Print `error: message` as one red line on stderr and exit with `code`."""
    stderr.print(f"[bold red]error:[/] [red]{escape(one_line(message))}[/]")
    raise typer.Exit(code)


@contextmanager
def status_spinner(message: str) -> Iterator[Any]:
    """A spinner on stderr when it is a terminal; yields the rich Status or None."""
    if not stderr.is_terminal:
        yield None
        return
    with stderr.status(message) as status:
        yield status


def check_device(device: str) -> None:
    """Refuse a device this machine does not have, before any model is loaded."""
    if device == "auto":
        return
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r} (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here (try --device cpu)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")
