"""The engine's owner loop: drain commands, step, report one turn at a time.

`run_core` owns an `LLMEngine` and nothing else: it takes commands (add, abort, stop) from an
`Inbox` and hands back plain events (`CoreReady`, `CoreTurn`, `CoreFailed`, `CoreStopped`)
through `emit`. It runs on a thread of the caller's process (`AsyncEngine`, the library and
the tests) or in a process of its own (`rlt serve`, `engine_process.py`): there the engine's
host work (planning, launches, detokenization) has an interpreter to itself, so an event loop
busy writing thousands of SSE chunks a second never holds the lock the engine needs to feed
the GPU. The events are plain dataclasses, pickled over a pipe in the second case (their
modules import no torch: an API server reads them without loading it). Right after
`CoreReady` comes a turn with only the engine's stats, so /metrics shows the KV pool and
start-up's graphs before the first request.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlt_engine.engine_info import EngineInfo
from rlt_engine.outputs import RequestOutput
from rlt_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rlt_engine.engine import LLMEngine
    from rlt_engine.outputs import EngineStats

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
    """The model failed to load, or the loop stopped on an unexpected error."""

    message: str


@dataclass
class CoreStopped:
    pass


@dataclass
class CoreTurn:
    """What one turn of the loop did: the adds it took or refused, then (`wall_s` set) one
    engine step's outputs, or (`wall_s` None) only the outputs of requests it aborted (the
    first turn, right after `CoreReady`, has only the engine's stats)."""

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
        emit(CoreFailed(f"model failed to load: {exc}"))
        return
    if on_loaded is not None:
        on_loaded(engine)
    emit(CoreReady(engine.info))
    # the engine's numbers before any request (the pool's size, the graphs captured at
    # start-up): without it /metrics showed a pool of 0 blocks until the first step
    emit(CoreTurn(stats=engine.stats()))
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
