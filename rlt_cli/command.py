"""What every engine-driving subcommand shares: one-line usage errors and a Typer callback
whose signature is assembled from `inspect.Parameter`s (so flags can come from dataclasses)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from typer.core import TyperCommand

from rlt_cli.output import USER_ERRORS, fail

try:  # recent typer vendors click as typer._click
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - older typer uses the click package
    from click.exceptions import UsageError


class OneLineUsageErrors(TyperCommand):
    """Bad flags are reported like every other error: one red line, exit code 2."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except UsageError as exc:
            hint = f"see `rlt {ctx.info_name} --help`"
            fail(f"{exc.format_message()} ({hint})", code=exc.exit_code)


def keyword(name: str, annotation: Any, default: Any = inspect.Parameter.empty) -> Any:
    kind = inspect.Parameter.KEYWORD_ONLY
    return inspect.Parameter(name, kind, default=default, annotation=annotation)


def callback(
    run: Callable[[dict[str, Any]], None], parameters: Sequence[inspect.Parameter], help: str
) -> Callable[..., None]:
    """A Typer callback taking `parameters` that hands their values to `run`; user errors
    and Ctrl-C become one red line."""

    def command(**values: Any) -> None:
        try:
            run(values)
        except USER_ERRORS as exc:
            fail(str(exc) or type(exc).__name__)
        except KeyboardInterrupt:
            fail("interrupted", code=130)

    command.__signature__ = inspect.Signature(list(parameters))  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in parameters}
    command.__doc__ = help
    return command
