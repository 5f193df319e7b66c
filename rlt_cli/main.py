"""The `rlt` command line: one engine, many front doors (docs/architecture.md).

Thin by design: commands parse flags, call an rlt_engine driver and render the result.
torch is imported only inside commands, never when this module loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import typer

from rlt_cli.bench import HELP as BENCH_HELP
from rlt_cli.bench import bench_command
from rlt_cli.command import OneLineUsageErrors, OneLineUsageGroup
from rlt_cli.download import download
from rlt_cli.eval import HELP as EVAL_HELP
from rlt_cli.eval import eval_command
from rlt_cli.generate import HELP as GENERATE_HELP
from rlt_cli.generate import generate_command
from rlt_cli.output import fail
from rlt_cli.profile import HELP as PROFILE_HELP
from rlt_cli.profile import profile_command
from rlt_cli.serve import HELP as SERVE_HELP
from rlt_cli.serve import serve_command
from rlt_engine import __version__

app = typer.Typer(
    name="rlt",
    help="Inference and serving for looped (recurrent-depth) language models: Ouro, Nanbeige.",
    no_args_is_help=True,
    add_completion=False,
    cls=OneLineUsageGroup,  # `rlt --bad-flag`, typos: one line, like every other error
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every subcommand
    pretty_exceptions_show_locals=False,  # locals may hold a --token
)

# Subcommands that exist in the plan but not yet in code: (one-line help, what they will do).
PLANNED: dict[str, tuple[str, str]] = {
    "pd-launch": ("Launch disaggregated prefill/decode workers.", "prefill/decode launcher"),
}
_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"rlt {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Inference and serving for looped (recurrent-depth) language models: Ouro, Nanbeige."""


app.command("download", cls=OneLineUsageErrors)(download)
app.command("generate", help=GENERATE_HELP, cls=OneLineUsageErrors)(generate_command())
app.command("bench", help=BENCH_HELP, cls=OneLineUsageErrors)(bench_command())
app.command("profile", help=PROFILE_HELP, cls=OneLineUsageErrors)(profile_command())
app.command("serve", help=SERVE_HELP, cls=OneLineUsageErrors)(serve_command())
app.command("eval", help=EVAL_HELP, cls=OneLineUsageErrors)(eval_command())


def _planned(name: str, plan: str) -> Callable[[typer.Context], None]:
    def command(ctx: typer.Context) -> None:
        fail(f"rlt {name} is not implemented yet (planned: {plan})", code=2)

    return command


for _name, (_help, _plan) in PLANNED.items():
    app.command(_name, help=_help, context_settings=_PASS_THROUGH, cls=OneLineUsageErrors)(
        _planned(_name, _plan)
    )


if __name__ == "__main__":
    app(prog_name="rlt")
