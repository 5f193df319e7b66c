"""Start `rlt serve`: resolve the served name, build the async engine and the app, run uvicorn.

Uvicorn owns the signals: on SIGTERM or Ctrl-C it stops accepting connections, waits for the
open requests to finish (up to DRAIN_TIMEOUT_S), then the app's lifespan stops the engine.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from typing import Any

from rlt_engine.async_engine import AsyncEngine
from rlt_engine.config import EngineConfig
from rlt_engine.heap import freeze_startup_heap
from rlt_engine.server.config import ServerConfig

DRAIN_TIMEOUT_S = 120
log = logging.getLogger("rlt.serve")


def served_names(
    engine_config: EngineConfig, server: ServerConfig
) -> tuple[EngineConfig, list[str], str | None]:
    """(the engine config with the model resolved, the names clients may use, a notice)."""
    from rlt_engine.checkpoints.resolve import default_model

    notice = None
    model = engine_config.model.model
    if model is None:
        model, notice = default_model()
        part = dataclasses.replace(engine_config.model, model=model)
        engine_config = dataclasses.replace(engine_config, model=part)
    return engine_config, list(server.served_model_name) or [model], notice


def make_server(engine_config: EngineConfig, server: ServerConfig) -> tuple[Any, AsyncEngine]:
    """The uvicorn server (not started) and its app, for `rlt serve` and tests."""
    from rlt_engine.engine_process import build_engine
    from rlt_engine.server.metrics import ServerMetrics

    engine_config, names, notice = served_names(engine_config, server)
    if notice:
        log.warning(notice)
    metrics = ServerMetrics(names[0], engine_config.scheduler.max_num_seqs)
    # the engine in a process of its own: the event loop's work for thousands of streams
    # never holds the interpreter lock that the engine's host work needs
    engine = AsyncEngine(
        functools.partial(build_engine, engine_config),
        on_step=metrics.record,
        stream_interval=server.stream_interval,
        engine_process=True,
    )
    return http_server(engine, server, names, metrics), engine


def http_server(
    engine: AsyncEngine, server: ServerConfig, names: list[str], metrics: Any, in_flight: Any = None
) -> Any:
    """The uvicorn server (not started) of the app over `engine`; it stops if the model fails
    to load. `in_flight`: see `build_app`."""
    import uvicorn

    from rlt_engine.server.app import build_app

    app = build_app(engine, server, names, metrics, in_flight)
    # loop and http stay "auto": uvloop and httptools (dependencies) where they install, else
    # asyncio and h11; every streamed chunk costs the event loop one socket write either way
    config = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        log_level="info",
        timeout_graceful_shutdown=DRAIN_TIMEOUT_S,
        access_log=False,
    )
    uvicorn_server = uvicorn.Server(config)

    def watch_load() -> None:
        if engine.wait_ready():  # the server's heap is complete (its tokenizer is loaded)
            freeze_startup_heap()
        elif engine.status == "dead":
            log.error(engine.error)
            uvicorn_server.should_exit = True  # a server without a model is no server

    threading.Thread(target=watch_load, name="rlt-load-watch", daemon=True).start()
    return uvicorn_server
