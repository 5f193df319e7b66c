"""The engine's owner loop: drain commands, step, report one turn at a time.

`run_core` owns an `LLMEngine` and nothing else: it takes commands (add, abort, stop) from an
`Inbox` and hands back plain events (`CoreReady`, `CoreTurn`, `CoreFailed`, `CoreStopped`)
through `emit`. It runs on a thread of the caller's process (`AsyncEngine`, the library and
the tests) or in a process of its own (`rlt serve`, `core_process_main`): there the engine's
host work (planning, launches, detokenization) has an interpreter to itself, so an event loop
busy writing thousands of SSE chunks a second never holds the lock the engine needs to feed
the GPU. The events are plain dataclasses, pickled over a pipe in the second case.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlt_engine.engine_info import EngineInfo
from rlt_engine.outputs import RequestOutput
from rlt_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from rlt_engine.config import EngineConfig
    from rlt_engine.engine import EngineStats, LLMEngine

IDLE_WAIT_S = 0.05  # how long an idle core sleeps before looking at its inbox again


# -- commands (caller -> core) -------------------------------------------------------------
@dataclass
class AddRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    # when the caller sent it: TTFT and E2E include the wait until the core drains it
    # (CLOCK_MONOTONIC is one clock for every process of the machine)
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class StopCore:
    """Stop taking requests and finish those that run; `now`: stop at once (the caller is
    gone, nobody reads the outputs)."""

    now: bool = False


Command = AddRequest | AbortRequest | StopCore


# -- events (core -> caller) ---------------------------------------------------------------
@dataclass
class CoreReady:
    info: EngineInfo


@dataclass
class CoreFailed:
    """The model failed to load (`loading`) or the loop stopped on an unexpected error."""

    message: str
    loading: bool = False


@dataclass
class CoreStopped:
    pass


@dataclass
class CoreTurn:
    """What one turn of the loop did: the adds it took or refused, then (`wall_s` set) one
    engine step's outputs, or (`wall_s` None) only the outputs of requests it aborted."""

    accepted: list[str] = field(default_factory=list)
    refused: list[tuple[str, str, str]] = field(default_factory=list)  # id, error type, message
    outputs: list[RequestOutput] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # id, why (a failed step)
    stats: EngineStats | None = None
    wall_s: float | None = None


Event = CoreReady | CoreFailed | CoreStopped | CoreTurn


class Inbox:
    """Commands for the core from any thread; the core drains them between steps."""

    def __init__(self) -> None:
        self._items: deque[Command] = deque()
        self._wake = threading.Event()

    def put(self, command: Command | list[Command]) -> None:
        """One command, or several sent together (taken on the same turn)."""
        if isinstance(command, list):
            self._items.extend(command)
        else:
            self._items.append(command)
        self._wake.set()

    def drain(self) -> list[Command]:
        items = []
        while self._items:
            items.append(self._items.popleft())
        return items

    def wait(self, timeout: float) -> None:
        self._wake.clear()
        if not self._items:
            self._wake.wait(timeout)


def run_core(
    make_engine: Callable[[], LLMEngine],
    inbox: Inbox,
    emit: Callable[[Event], None],
    on_loaded: Callable[[LLMEngine], None] | None = None,
) -> None:
    """Load the engine, then step it until a StopCore; every outcome is an event."""
    try:
        engine = make_engine()
    except BaseException as exc:
        emit(CoreFailed(f"model failed to load: {exc}", loading=True))
        return
    if on_loaded is not None:
        on_loaded(engine)
    emit(CoreReady(engine.info))
    try:
        _loop(engine, inbox, emit)
    except BaseException as exc:
        emit(CoreFailed(f"engine stopped: {type(exc).__name__}: {exc}"))
        return
    emit(CoreStopped())


def _loop(engine: LLMEngine, inbox: Inbox, emit: Callable[[Event], None]) -> None:
    from rlt_engine.engine import StepFailedError

    stopping = False
    while True:
        commands = inbox.drain()
        if commands:
            turn, stop = _apply(engine, commands)
            if stop is not None and stop.now:
                return  # the caller is gone: its process's memory goes with it
            stopping = stopping or stop is not None
            if turn.accepted or turn.refused or turn.outputs:
                turn.stats = engine.stats()
                emit(turn)
        busy = engine.has_unfinished_requests()
        if stopping and not busy:
            return
        if not busy:
            inbox.wait(IDLE_WAIT_S)
            continue
        start = time.perf_counter()
        turn = CoreTurn()
        try:
            turn.outputs = engine.step()
        except StepFailedError as exc:
            turn.failed = [(rid, str(exc)) for rid in exc.request_ids]
        turn.wall_s = time.perf_counter() - start
        turn.stats = engine.stats()
        emit(turn)


def _apply(engine: LLMEngine, commands: list[Command]) -> tuple[CoreTurn, StopCore | None]:
    turn, stop = CoreTurn(), None
    for command in commands:
        if isinstance(command, StopCore):
            stop = command
        elif isinstance(command, AbortRequest):
            out = engine.abort_request(command.request_id)
            if out is not None:
                turn.outputs.append(out)
        elif stop is not None:  # the core is stopping: nothing new
            turn.refused.append(
                (command.request_id, "EngineDeadError", "the engine is shutting down")
            )
        else:
            try:
                engine.add_request(
                    command.prompt, command.params, command.request_id, arrival_time=command.arrival
                )
            except Exception as exc:
                turn.refused.append((command.request_id, type(exc).__name__, str(exc)))
                continue
            turn.accepted.append(command.request_id)
    return turn, stop


# -- the core in a process of its own -------------------------------------------------------
def build_engine(config: EngineConfig) -> LLMEngine:
    """`LLMEngine(config)`, imported here: with `functools.partial(build_engine, config)` as
    the engine process's factory, the server process does not load torch and the model code
    for itself."""
    from rlt_engine.engine import LLMEngine

    return LLMEngine(config)


class PromptIds:
    """Each request's prompt ids cross the pipe once, with its first output: every later
    delta would carry the whole prompt again (at c=256 with 2,000-token prompts, half a
    million ints a step). The engine process `strip`s them, the caller `restore`s them; both
    see the same turns in the same order."""

    def __init__(self) -> None:
        self._ids: dict[str, list[int]] = {}  # requests whose ids have crossed (the caller's)

    def strip(self, turn: CoreTurn) -> None:
        for out in turn.outputs:  # the turn's own outputs, made for this send
            if out.request_id in self._ids:
                out.prompt_token_ids = []
            if out.finished:
                self._ids.pop(out.request_id, None)
            else:
                self._ids[out.request_id] = []  # sent; nothing kept on this side
        for rid, _ in turn.failed:
            self._ids.pop(rid, None)

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


def core_process_main(
    make_engine: Callable[[], LLMEngine], commands: Connection, events: Connection
) -> None:
    """The engine process: a reader thread moves commands from the pipe into the inbox (so
    the caller's sends never wait on a step), the main thread runs the core and sends its
    events back. It stops when the caller says so, or at once when the caller's end closes
    (the server died); signals meant for the server's process group leave it running."""
    # Ctrl-C (the terminal's process group) and SIGTERM to the whole group (systemd's default
    # KillMode) are the server's: it drains its requests, then sends StopCore
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inbox = Inbox()

    def read() -> None:
        while True:
            try:
                inbox.put(commands.recv())
            except (EOFError, OSError):
                inbox.put(StopCore(now=True))
                return

    threading.Thread(target=read, name="rlt-core-commands", daemon=True).start()

    prompts = PromptIds()

    def emit(event: Any) -> None:
        if isinstance(event, CoreTurn):
            prompts.strip(event)
        events.send(event)

    try:
        with contextlib.suppress(OSError):  # a closed pipe: nobody listens any more
            run_core(make_engine, inbox, emit)
    finally:
        events.close()
