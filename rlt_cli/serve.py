"""`rlt serve [MODEL]`: the OpenAI-compatible HTTP server (rlt_engine.server)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Annotated, Any

import typer

from rlt_cli.command import callback, keyword
from rlt_cli.options import (
    dataclass_parameters,
    engine_fields,
    engine_parameters,
    to_field_values,
)
from rlt_engine.config import EngineConfig
from rlt_engine.server.config import ServerConfig

HELP = (
    "Serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
    "/health, /metrics). Every engine flag of `rlt generate` applies."
)
SERVER_HELP = {
    "host": "Address to listen on.",
    "port": "Port to listen on.",
    "api_key": "Require `Authorization: Bearer KEY` on /v1/* (default: $RLT_API_KEY, else none).",
    "served_model_name": "Model name(s) clients use in requests (repeatable; default: the model "
    "as given).",
    "max_concurrent_requests": "Generation requests at once; more get 429 with Retry-After.",
    "request_timeout": "Seconds a request may take before it is aborted (408).",
    "max_request_bytes": "Largest request body; larger ones get 413.",
    "stream_interval": "Tokens a streamed response gathers per chunk (the first token and the "
    "end go at once); larger: fewer chunks, less server CPU per token at high concurrency.",
    "api_server_count": "API server processes (one event loop each) on one socket, all served "
    "by one engine process; more than 1 when one event loop cannot keep up.",
}
_MODEL_ARGUMENT = keyword(
    "model_argument",
    Annotated[
        str | None,
        typer.Argument(
            metavar="MODEL", show_default=False, help="Same as --model (as in `vllm serve`)."
        ),
    ],
    None,
)


def _run(values: dict[str, Any]) -> None:
    engine_options = to_field_values(values, [f.name for f in engine_fields()])
    positional = values["model_argument"]
    if positional is not None:
        if engine_options.get("model") not in (None, positional):
            raise ValueError("give the model once: as MODEL or as --model, not both")
        engine_options["model"] = positional
    engine_config = EngineConfig.from_options(**engine_options)
    server_options = to_field_values(values, [n for n in SERVER_HELP])
    server_options.setdefault("api_key", os.environ.get("RLT_API_KEY") or None)
    server = ServerConfig(**server_options)
    from rlt_cli.output import check_device

    check_device(engine_config.model.device)
    if engine_config.model.model is not None:  # a missing model fails now, not after start-up
        from rlt_engine.checkpoints.resolve import resolve_model_dir

        mc = engine_config.model
        resolve_model_dir(mc.model, mc.revision, mc.load_format)
    if server.api_server_count > 1:
        from rlt_engine.server.api_servers import run_api_servers

        if run_api_servers(engine_config, server):
            raise ValueError("an API server failed (its error is above)")
        return
    from rlt_engine.server.launch import make_server

    uvicorn_server, engine = make_server(engine_config, server)
    run_until_stopped(uvicorn_server)
    if engine.status == "dead":
        raise ValueError(engine.error or "the engine failed")


def run_until_stopped(uvicorn_server: Any) -> None:
    """Serve until SIGTERM or Ctrl-C, then drain; a stop asked for is a success (exit 0).
    Uvicorn re-raises the signal after its drain; for SIGINT, asyncio's runner then raises
    KeyboardInterrupt or returns depending on a race, so both end here."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn_server.run()


def serve_command() -> Any:
    server = dataclass_parameters(ServerConfig, "Server", SERVER_HELP)
    parameters = [_MODEL_ARGUMENT, *engine_parameters(), *server]
    return callback(_run, parameters, HELP)
