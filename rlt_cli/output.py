"""Shared console output: rich for people, one red line for errors."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

stdout = Console(highlight=False, soft_wrap=True)
stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def one_line(text: str) -> str:
    return " ".join(text.split())


def fail(message: str, code: int = 1) -> NoReturn:
    """Print `error: message` as one red line on stderr and exit with `code`."""
    stderr.print(f"[bold red]error:[/] [red]{escape(one_line(message))}[/]")
    raise typer.Exit(code)
