"""The engine in a process of its own, answering one or more API servers over pipes.

`engine_main` runs `engine_core.run_core` on its main thread. Each API server (a client) has a
command pipe and an event pipe; a reader thread per client moves its commands into the core's
inbox, so a server's sends never wait on a step, and notes which client added which request.
The main thread sends each client the part of every turn that is its own: its adds' answers,
its requests' outputs. One client (the first still connected) also gets every turn's engine
stats and step time, so the engine-wide metrics are counted once.

The process stops when its last client has said StopCore (after finishing what runs), or at
once when every client's pipe has closed (the servers died). A client that goes away while
others stay has its requests aborted. SIGINT and SIGTERM are ignored: a terminal's Ctrl-C and
systemd's default stop reach the whole process group, and the servers drain first.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlt_engine.engine_core import (
    AbortRequest,
    AddRequest,
    Command,
    CoreTurn,
    Inbox,
    StopCore,
    run_core,
)
from rlt_engine.heap import freeze_startup_heap

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from rlt_engine.config import EngineConfig
    from rlt_engine.engine import LLMEngine


def build_engine(config: EngineConfig) -> LLMEngine:
    """`LLMEngine(config)`, imported here: with `functools.partial(build_engine, config)` as
    the engine process's factory, the server process does not load torch and the model code
    for itself."""
    from rlt_engine.engine import LLMEngine

    return LLMEngine(config)


def client_pipes(ctx: Any, count: int) -> tuple[list[Any], list[Any]]:
    """Pipes for `count` clients from multiprocessing context `ctx`: (the engine's ends, the
    servers' ends), each a (commands, events) pair per client; commands flow to the engine,
    events back."""
    engine_ends, server_ends = [], []
    for _ in range(count):
        commands_out, commands_in = ctx.Pipe(duplex=False)
        events_out, events_in = ctx.Pipe(duplex=False)
        engine_ends.append((commands_out, events_in))
        server_ends.append((commands_in, events_out))
    return engine_ends, server_ends


class PromptIds:
    """Each request's prompt ids cross the pipe once, with its first output: every later
    delta would carry the whole prompt again (at c=256 with 2,000-token prompts, half a
    million ints a step). The engine process `strip`s them, the caller `restore`s them; both
    see the same turns in the same order."""

    def __init__(self) -> None:
        self._sent: set[str] = set()  # the engine's side: requests whose ids have crossed
        self._ids: dict[str, list[int]] = {}  # the caller's side: those ids

    def strip(self, turn: CoreTurn) -> None:
        for out in turn.outputs:  # the turn's own outputs, made for this send
            if out.request_id in self._sent:
                out.prompt_token_ids = []
                if out.finished:
                    self._sent.discard(out.request_id)
            elif not out.finished:
                self._sent.add(out.request_id)
        for rid, _ in turn.failed:
            self._sent.discard(rid)

    def restore(self, turn: CoreTurn) -> None:
        for out in turn.outputs:
            ids = self._ids.get(out.request_id)
            if ids is not None:
                out.prompt_token_ids = ids
            if out.finished:
                self._ids.pop(out.request_id, None)
            elif ids is None:
                self._ids[out.request_id] = out.prompt_token_ids
        for rid, _ in turn.failed:
            self._ids.pop(rid, None)


class Clients:
    """The API servers an engine process answers, and which of them owns each request."""

    def __init__(self, events: list[Connection], inbox: Inbox) -> None:
        self.events, self.inbox = events, inbox
        self.owner: dict[str, int] = {}  # request id -> client (set by the readers)
        self._lock = threading.Lock()
        self._connected = set(range(len(events)))
        self._stopped: set[int] = set()  # said StopCore (as opposed to closing its pipe)

    # -- the reader threads ---------------------------------------------------------------
    def read(self, client: int, commands: Connection) -> None:
        while True:
            try:
                item = commands.recv()
            except (EOFError, OSError):
                return self._leave(client, stopped=False)
            items: list[Command] = item if isinstance(item, list) else [item]
            for command in items:
                if isinstance(command, AddRequest):
                    self.owner[command.request_id] = client
            if any(isinstance(c, StopCore) for c in items):
                self.inbox.put([c for c in items if not isinstance(c, StopCore)])
                return self._leave(client, stopped=True)
            self.inbox.put(items)

    def _leave(self, client: int, stopped: bool) -> None:
        with self._lock:
            self._connected.discard(client)
            if stopped:
                self._stopped.add(client)
            last = not self._connected
        if not stopped:  # gone: nobody reads its requests' outputs
            mine = [rid for rid, c in list(self.owner.items()) if c == client]
            self.inbox.put([AbortRequest(rid) for rid in mine])
        if last:  # graceful if any client asked for it, else at once
            self.inbox.put(StopCore(now=not self._stopped))

    # -- the main thread ------------------------------------------------------------------
    def emit(self, event: Any) -> None:
        if not isinstance(event, CoreTurn):
            for client in range(len(self.events)):
                self._send(client, event)
            return
        for client, turn in self._split(event).items():
            self._send(client, turn)

    def _split(self, turn: CoreTurn) -> dict[int, CoreTurn]:
        with self._lock:
            stats_client = min(self._connected, default=0)
        parts: dict[int, CoreTurn] = {stats_client: CoreTurn(stats=turn.stats, wall_s=turn.wall_s)}

        def part(rid: str, done: bool) -> CoreTurn | None:
            client = self.owner.pop(rid, None) if done else self.owner.get(rid)
            return None if client is None else parts.setdefault(client, CoreTurn())

        for rid in turn.accepted:
            if (p := part(rid, done=False)) is not None:
                p.accepted.append(rid)
        for refusal in turn.refused:
            if (p := part(refusal[0], done=True)) is not None:
                p.refused.append(refusal)
        for out in turn.outputs:
            if (p := part(out.request_id, done=out.finished)) is not None:
                p.outputs.append(out)
        for failure in turn.failed:
            if (p := part(failure[0], done=True)) is not None:
                p.failed.append(failure)
        return parts

    def _send(self, client: int, event: Any) -> None:
        with contextlib.suppress(OSError):  # that client is gone; its reader says so
            self.events[client].send(event)


def engine_main(
    make_engine: Callable[[], LLMEngine], pipes: list[tuple[Connection, Connection]]
) -> None:
    """The engine process's entry: `pipes` holds each client's (commands, events) ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inbox = Inbox()
    clients = Clients([events for _, events in pipes], inbox)
    for client, (commands, _) in enumerate(pipes):
        name = f"rlt-engine-client-{client}"
        threading.Thread(
            target=clients.read, args=(client, commands), name=name, daemon=True
        ).start()
    prompts = PromptIds()

    def emit(event: Any) -> None:
        if isinstance(event, CoreTurn):
            prompts.strip(event)
        clients.emit(event)

    try:
        # this process keeps its engine for life: its startup heap need never be walked again
        run_core(make_engine, inbox, emit, on_loaded=lambda _: freeze_startup_heap())
    finally:
        for _, events in pipes:
            events.close()
