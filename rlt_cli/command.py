"""What every subcommand shares: one-line usage errors (for `rlt` itself too), plain help
metavars, and a Typer callback whose signature is assembled from `inspect.Parameter`s (so
flags can come from dataclasses)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from rlt_cli.output import USER_ERRORS, end_partial_line, fail, flag_message

try:  # recent typer vendors click as typer._click
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer uses the click package
    from click.exceptions import NoArgsIsHelpError, UsageError


def _usage_error(ctx: Any, exc: UsageError, command: str) -> None:
    if isinstance(exc, NoArgsIsHelpError):  # `rlt` alone prints the help, as asked
        raise exc
    fail(f"{exc.format_message()} (see `{command} --help`)", code=exc.exit_code)


def _plain_help(params: list[Any], ctx: Any) -> list[Any]:
    """Help without typer's type labels that say nothing to a user: no `<bool>` on on/off flags,
    `<str>` (not `<list[str]>`) on a repeatable flag, no type on a positional argument."""
    for param in params:
        if isinstance(param, TyperOption) and param.metavar is None:
            if param.is_flag:
                param.metavar = ""
            elif param.multiple and hasattr(param, "display_type"):  # older typer: keep its own
                param.metavar = re.sub(r"^<list\[(.+)\]>$", r"<\1>", param.display_type(ctx))
        elif isinstance(param, TyperArgument):
            param.display_type_rich = lambda ctx: None  # type: ignore[method-assign]
    return params


class OneLineUsageErrors(TyperCommand):
    """Bad flags are reported like every other error: one red line, exit code 2."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except UsageError as exc:
            _usage_error(ctx, exc, f"rlt {ctx.info_name}")
            raise  # pragma: no cover - _usage_error exits

    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_help(super().get_params(ctx), ctx)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        # `{PROMPT}...` is typer's mark of a required argument: show `PROMPT...` instead.
        return [re.sub(r"^\{(.+)\}", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]


class OneLineUsageGroup(TyperGroup):
    """`rlt --bad-flag` and `rlt genrate` get the same one line as a subcommand's bad flag."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except UsageError as exc:
            _usage_error(ctx, exc, "rlt")
            raise  # pragma: no cover

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        try:
            return super().resolve_command(ctx, args)
        except UsageError as exc:
            _usage_error(ctx, exc, "rlt")
            raise  # pragma: no cover

    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_help(super().get_params(ctx), ctx)


def keyword(name: str, annotation: Any, default: Any = inspect.Parameter.empty) -> Any:
    kind = inspect.Parameter.KEYWORD_ONLY
    return inspect.Parameter(name, kind, default=default, annotation=annotation)


def callback(
    run: Callable[[dict[str, Any]], None],
    parameters: Sequence[inspect.Parameter],
    help: str,
    flags: Mapping[str, str] | None = None,
) -> Callable[..., None]:
    """A Typer callback taking `parameters` that hands their values to `run`; user errors
    and Ctrl-C become one red line. Engine and sampling field names in an error (`max_tokens`,
    `load_format='dummy'`) are written as this command's flags: `flags` maps a field to its
    flag where that is not `--field-name` (e.g. max_tokens -> --output-len in `rlt bench`)."""
    names = [p.name for p in parameters]

    def command(**values: Any) -> None:
        try:
            run(values)
        except USER_ERRORS as exc:
            fail(flag_message(str(exc) or type(exc).__name__, names, flags or {}))
        except KeyboardInterrupt:
            end_partial_line()
            fail("interrupted", code=130)

    command.__signature__ = inspect.Signature(list(parameters))  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in parameters}
    command.__doc__ = help
    return command
