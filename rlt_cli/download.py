"""`rlt download`: fetch a checkpoint at its pinned revision and verify it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.filesize import decimal
from rich.markup import escape

from rlt_cli.output import fail, one_line, stderr, stdout


def download(
    model: Annotated[
        str,
        typer.Argument(
            metavar="MODEL",
            help="Alias (demo, ouro, ouro-2.6b, ouro-thinking, nanbeige, ...) or org/name.",
        ),
    ],
    revision: Annotated[
        str | None,
        typer.Option(help="Branch, tag or commit (default: the alias's pinned commit, else main)."),
    ] = None,
    local_dir: Annotated[
        Path | None,
        typer.Option(file_okay=False, help="Put the files here instead of the Hugging Face cache."),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(help="Hub access token for gated/private repos (default: HF_TOKEN or login)."),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of text.")
    ] = False,
) -> None:
    """Download a model (config, safetensors, tokenizer; never remote code) and verify it."""
    from rlt_cli.progress import download_progress
    from rlt_engine.checkpoints.hub import HubError, download_model

    def failed(message: str, code: int = 1) -> None:
        if json_output:  # a machine asked: the failure is JSON too, on stdout
            typer.echo(json.dumps({"error": one_line(message), "model": model}))
            raise typer.Exit(code)
        fail(message, code=code)

    try:
        with download_progress(stderr, enabled=stderr.is_terminal) as tqdm_class:
            result = download_model(
                model, revision=revision, local_dir=local_dir, token=token, progress=tqdm_class
            )
    except (HubError, ValueError, OSError) as exc:
        failed(str(exc) or type(exc).__name__)
        return
    except KeyboardInterrupt:
        failed("interrupted", code=130)
        return

    if json_output:
        typer.echo(json.dumps(result.to_dict()))
        return
    revision_text = result.revision[:12] if result.revision else "main"
    state = "already present" if result.already_present else "downloaded"
    stdout.print(
        f"[green]✓[/] {escape(result.repo_id)} @ {revision_text}: {state} and verified "
        f"({len(result.files)} checkpoint files, {decimal(result.total_bytes)})"
    )
    stdout.print(f"  {escape(str(result.path))}")
