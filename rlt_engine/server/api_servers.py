"""`rlt serve --api-server-count N`: one engine process, N API server processes.

One API server process is one event loop: HTTP parsing, JSON and a socket write per streamed
chunk, 50-64 us of one core per output token on the H200's host at c=64/256
(`benchmarks/results/2026-12-05-measured-h200.md`), so somewhere past 15,000 streamed tokens a
second it, not the engine, sets the pace (merging queued deltas into larger chunks moves that
point, not away). As vLLM's `--api-server-count`, this runs N of them over one listening
socket (the kernel hands each new connection to one of them) and one engine process that
answers them all (`engine_process.Clients`).

This process only supervises: it binds the socket (a taken port fails here, in one line),
starts the engine and the servers, passes SIGTERM and Ctrl-C on to the servers as SIGTERM
(each drains its requests; the engine stops with the last of them), and stops the rest if a
server dies. The servers' Prometheus metrics share a directory (`PROMETHEUS_MULTIPROC_DIR`):
`/metrics` on any of them counts every server's requests; the engine's own series come from
one of them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from rlt_engine.config import EngineConfig
from rlt_engine.server.config import ServerConfig

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

log = logging.getLogger("rlt.serve")
STOP_TIMEOUT_S = 150  # the servers' drain (120 s) and then some


def run_api_servers(engine_config: EngineConfig, server: ServerConfig) -> int:
    """Serve until stopped; the exit code (0 after SIGTERM or Ctrl-C, 1 if a server failed)."""
    from rlt_engine.engine_process import build_engine, client_pipes, engine_main
    from rlt_engine.server.launch import served_names

    engine_config, names, notice = served_names(engine_config, server)
    if notice:
        log.warning(notice)
    count = server.api_server_count
    listener = _listen(server.host, server.port)
    metrics_dir = tempfile.mkdtemp(prefix="rlt-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # the servers inherit it
    ctx = multiprocessing.get_context("spawn")
    engine_ends, server_ends = client_pipes(ctx, count)
    engine = ctx.Process(
        target=engine_main,
        args=(functools.partial(build_engine, engine_config), engine_ends),
        name="rlt-engine",
        daemon=True,
    )
    in_flight = ctx.Value("i", 0)  # one --max-concurrent-requests count for all servers
    servers = [
        ctx.Process(
            target=api_server_main,
            args=(engine_config, server, names, commands, events, listener, in_flight),
            name=f"rlt-api-server-{i}",
            daemon=True,
        )
        for i, (commands, events) in enumerate(server_ends)
    ]
    signals: list[int] = []

    def stop(sig: int = signal.SIGTERM, frame: Any = None) -> None:
        signals.append(sig)
        for proc in servers:  # SIGTERM, never a second SIGINT (uvicorn's force-quit)
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        engine.start()
        for proc in servers:
            proc.start()
        for ends in (*engine_ends, *server_ends):  # the children hold theirs now
            for end in ends:
                end.close()
        port = listener.getsockname()[1]  # --port 0: the one the system chose
        listener.close()
        host = f"[{server.host}]" if ":" in server.host else server.host
        print(
            f"INFO:     rlt: {count} API servers on http://{host}:{port} "
            "(one engine process; Press CTRL+C to quit)",
            file=sys.stderr,
            flush=True,
        )
        _supervise(servers, stop, signals)
        engine.join(STOP_TIMEOUT_S)  # it stops with its last server
        if engine.is_alive():
            engine.kill()
            engine.join()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 1 if any(proc.exitcode != 0 for proc in servers) else 0


def _supervise(servers: list[Any], stop: Any, signals: list[int]) -> None:
    """Wait until every server has exited; if one exits while the others serve (it failed),
    stop the others."""
    while True:
        alive = [proc for proc in servers if proc.is_alive()]
        if not alive:
            return
        if len(alive) < len(servers) and not signals:
            log.error("an API server exited; stopping the others")
            stop()
        multiprocessing.connection.wait([proc.sentinel for proc in alive], timeout=1.0)


def _listen(host: str, port: int) -> socket.socket:
    """The one listening socket every server accepts on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"--port {port}: cannot listen on {host}: {exc.strerror}") from None
    sock.listen(2048)
    return sock


def api_server_main(
    engine_config: EngineConfig,
    server: ServerConfig,
    names: list[str],
    commands: Connection,
    events: Connection,
    listener: socket.socket,
    in_flight: Any,
) -> None:
    """One API server process: the app over its pipe ends to the engine, served by uvicorn
    on the shared socket."""
    from rlt_engine.async_engine import AsyncEngine
    from rlt_engine.server.launch import http_server
    from rlt_engine.server.metrics import ServerMetrics
    from rlt_engine.server.serving import InFlight

    metrics = ServerMetrics(names[0], engine_config.scheduler.max_num_seqs)
    engine = AsyncEngine.attach(
        commands, events, on_step=metrics.record, stream_interval=server.stream_interval
    )
    admitted = InFlight(server.max_concurrent_requests, in_flight)
    uvicorn_server = http_server(engine, server, names, metrics, admitted)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # uvicorn re-raises it after the drain
    with contextlib.suppress(KeyboardInterrupt):  # a stop asked for (see rlt_cli/serve.py)
        uvicorn_server.run(sockets=[listener])
    if engine.status == "dead":
        sys.exit(1)
