"""Shared console output: rich for people, one red line for errors."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

stdout = Console(highlight=False, soft_wrap=True)
stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def print_table(table: Any) -> None:
    """Print a table of numbers on stdout at its natural width where the terminal is
    narrower (Rich would fit it to the terminal, 80 columns when piped, cutting numbers to
    '1629…'): the terminal wraps its lines instead. Name columns that may be cut carry their
    own max_width."""
    need = stdout.measure(table, options=stdout.options.update(max_width=1 << 16)).maximum
    width = stdout.width
    if need <= width:
        stdout.print(table)
        return
    stdout.width = need
    try:
        stdout.print(table)
    finally:
        stdout.width = width


# What a command turns into one readable line. Every model/config/checkpoint/tokenizer error
# of the engine derives from one of these (ModelNotFoundError is a FileNotFoundError;
# ConfigError, CheckpointError and TokenizerError are ValueErrors; tests/cli/test_generate.py
# checks it), so the torch-importing modules that define them need not be imported just to
# print a flag error.
USER_ERRORS = (ValueError, FileNotFoundError)


def one_line(text: str) -> str:
    return " ".join(text.split())


# Whether stdout's last streamed text ended mid-line (so an error after Ctrl-C starts a new one).
_partial_line = [False]


def stream_text(text: str) -> None:
    """Write streamed text to stdout now, remembering whether it left a line open."""
    if text:
        stdout.out(text, end="")
        _partial_line[0] = not text.endswith("\n")
    stdout.file.flush()  # keep text and stderr notices in order when piped


def end_partial_line() -> None:
    """Close a line of streamed text, so the next message starts on its own line."""
    if _partial_line[0]:
        stdout.out("")
        stdout.file.flush()
        _partial_line[0] = False


def flag_message(message: str, names: Iterable[str], flags: Mapping[str, str]) -> str:
    """`message` with the Python names of this command's options written as flags:
    `load_format='dummy'` -> `--load-format dummy`, `max_tokens (0) must` -> `--max-tokens (0)
    must`. A name with an underscore is replaced wherever it stands as a word; a one-word name
    (model, seed, ...) only as `name=value` or `name must`, so prose keeps its words."""
    for name in sorted(set(names) | set(flags), key=len, reverse=True):
        flag = flags.get(name, "--" + name.replace("_", "-"))
        word = rf"(?<![\w/.\-`']){re.escape(name)}(?![\w/\-])"
        message = re.sub(word + r"='([^']*)'", rf"{flag} \1", message)
        message = re.sub(word + r"=(\S+)", rf"{flag} \1", message)
        if "_" in name:
            message = re.sub(word, flag, message)
        else:
            message = re.sub(word + r"(?= must\b)", flag, message)
    return message


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
