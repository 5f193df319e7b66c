"""AsyncEngine: one owner thread steps an `LLMEngine`; asyncio callers stream its outputs.

The engine thread is the only one that touches the engine. Callers talk to it through a
command queue (add, abort) that it drains between steps, and get their outputs back through
their own asyncio queue: after each step the thread hands the whole step's outputs to each
caller's event loop in one `call_soon_threadsafe`, so it never waits on a client, however slow.

Faults stay where they happen: a bad request is refused at add (the caller gets the
`ValueError`); a request whose detokenizer or stop matching fails finishes alone with
finish_reason "error" (see `LLMEngine.step`); a failed worker step fails only the requests it
carried (`StepFailedError`); only an error outside those marks the engine dead, and then every
open stream gets `EngineDeadError` and `/health` says 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from rlt_engine.engine import EngineStats, LLMEngine, StepFailedError
from rlt_engine.outputs import RequestOutput
from rlt_engine.sampling_params import SamplingParams

IDLE_WAIT_S = 0.05  # how long the idle thread sleeps before looking at the queue again


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an unexpected error; nothing more can run."""


class EngineNotReadyError(RuntimeError):
    """The model is still loading."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine; other requests are unaffected."""


class RequestStream:
    """One request's outputs, in order: deltas, those already queued merged into one; the last
    has finished=True. Iterating raises RequestFailedError or EngineDeadError if the request
    fails. `abort()` (idempotent; a no-op once finished) frees the request's KV on the
    engine's next turn."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.request_id, self._engine = request_id, engine
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self._held: BaseException | None = None  # an error taken while merging, raised next
        self.done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = self._held if self._held is not None else await self.queue.get()
        self._held = None
        # Deltas that queued up while the caller was busy (a server behind the engine) come
        # out as one: one SSE chunk for them, so a loaded event loop writes fewer, larger
        # chunks instead of falling further behind. A caller that keeps up sees every step's.
        if isinstance(item, RequestOutput) and not item.finished and not self.queue.empty():
            deltas = [item]
            while not (deltas[-1].finished or self.queue.empty()):
                later = self.queue.get_nowait()
                if isinstance(later, BaseException):
                    self._held = later  # the outputs before it first
                    break
                deltas.append(later)
            item = RequestOutput.merged(deltas)
        if isinstance(item, BaseException):
            self.done = True  # the engine already dropped it
            raise item
        if item.finished:
            self.done = True
        return item

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self._engine._send(_Abort(self.request_id))


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    accepted: concurrent.futures.Future[None]
    loop: asyncio.AbstractEventLoop
    stream: RequestStream
    final_only: bool = False
    # when the caller sent it: its arrival, so TTFT and E2E include the wait for the engine
    # thread to drain the queue between steps (as vLLM counts from arrival at the server)
    sent: float = field(default_factory=time.monotonic)


@dataclass
class _Abort:
    request_id: str


@dataclass
class StepReport:
    """What the engine thread did in one step, for metrics: read on the engine thread."""

    stats: EngineStats
    outputs: list[RequestOutput]
    wall_s: float
    failed: int = 0  # requests failed by the step


@dataclass
class _Route:
    """Where a request's outputs go, and what the engine thread holds back for it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]
    final_only: bool = False  # send nothing before the end
    held: list[RequestOutput] = field(default_factory=list)  # deltas not yet sent
    held_tokens: int = 0  # their new tokens
    token_sent: bool = False  # the first token goes at once (time to first token)

    def hold(self, out: RequestOutput) -> None:
        self.held.append(out)
        self.held_tokens += len(out.new_token_ids)

    def take(self) -> list[RequestOutput]:
        """The held deltas as one output (none if nothing is held), no longer held."""
        if not self.held:
            return []
        out = RequestOutput.merged(self.held)
        self.token_sent = self.token_sent or self.held_tokens > 0
        self.held, self.held_tokens = [], 0
        return [out]


@dataclass
class _State:
    status: str = "loading"  # loading | ready | dead | stopped
    error: str | None = None
    streams: dict[str, _Route] = field(default_factory=dict)


class AsyncEngine:
    def __init__(
        self,
        make_engine: Callable[[], LLMEngine],
        *,
        on_step: Callable[[StepReport], None] | None = None,
        stream_interval: int = 1,
    ) -> None:
        """`stream_interval`: tokens a request's outputs gather on the engine thread before
        they go to the caller as one (the output with its first token, and its last, go at
        once)."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self._make_engine, self._on_step = make_engine, on_step
        self.stream_interval = stream_interval
        self._commands: deque[_Add | _Abort] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._state = _State()
        self._loaded = threading.Event()
        self.engine: LLMEngine | None = None
        self._thread = threading.Thread(target=self._run, name="rlt-engine", daemon=True)

    # -- lifecycle (any thread) -----------------------------------------------------------
    def start(self) -> None:
        """Load the model and start stepping, both on the engine thread; returns at once."""
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._loaded.wait(timeout)
        return self._state.status == "ready"

    @property
    def status(self) -> str:
        return self._state.status

    @property
    def error(self) -> str | None:
        return self._state.error

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop after the requests still running finish (or `timeout`); abort what is left."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- requests (asyncio callers) -------------------------------------------------------
    async def add(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        final_only: bool = False,
    ) -> RequestStream:
        """Queue a request and wait until the engine accepted it. Raises ValueError for a
        request the engine refuses (nothing is left behind). `final_only`: the stream yields
        one output, the finished one (a caller that wants no deltas: the engine thread keeps
        them and the caller's loop is woken once)."""
        self._check_accepting()
        stream = RequestStream(self, request_id)
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()
        loop = asyncio.get_running_loop()
        self._send(_Add(request_id, prompt, params, accepted, loop, stream, final_only))
        try:
            await asyncio.wrap_future(accepted)
        except BaseException:
            stream.abort()  # cancelled while queued: make sure it never runs
            raise
        return stream

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """`add`, then the outputs; leaving the loop early aborts the request."""
        stream = await self.add(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def _check_accepting(self) -> None:
        status = self._state.status
        if status == "loading":
            raise EngineNotReadyError("the model is still loading")
        if status != "ready" or self._stopping:
            raise EngineDeadError(self._state.error or "the engine is shutting down")

    def _send(self, command: _Add | _Abort) -> None:
        self._commands.append(command)
        self._wake.set()

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._make_engine()
        except BaseException as exc:
            self._state.status, self._state.error = "dead", f"model failed to load: {exc}"
            self._loaded.set()
            return
        self._state.status = "ready"
        self._loaded.set()
        try:
            self._loop(self.engine)
        except BaseException as exc:
            self._die(f"engine stopped: {type(exc).__name__}: {exc}")
            return
        self._state.status = "stopped"
        self._fail_all(EngineDeadError("the engine stopped"))

    def _loop(self, engine: LLMEngine) -> None:
        while True:
            self._drain(engine)
            busy = engine.has_unfinished_requests()
            if self._stopping and not busy:
                return
            if not busy:
                self._wake.clear()
                if not self._commands:
                    self._wake.wait(IDLE_WAIT_S)
                continue
            start = time.perf_counter()
            failed = 0
            try:
                outputs = engine.step()
            except StepFailedError as exc:
                outputs, failed = [], len(exc.request_ids)
                for rid in exc.request_ids:
                    self._deliver_error(rid, RequestFailedError(str(exc)))
            self._deliver(outputs)
            self._report(engine, outputs, time.perf_counter() - start, failed)

    def _drain(self, engine: LLMEngine) -> None:
        aborted = []
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, _Abort):
                if self._state.streams.pop(command.request_id, None) is not None:
                    out = engine.abort_request(command.request_id)
                    if out is not None:
                        aborted.append(out)
                continue
            if command.accepted.cancelled():
                continue
            try:
                engine.add_request(
                    command.prompt, command.params, command.request_id, arrival_time=command.sent
                )
            except Exception as exc:
                command.accepted.set_exception(exc)
                continue
            route = _Route(command.loop, command.stream.queue, command.final_only)
            self._state.streams[command.request_id] = route
            command.accepted.set_result(None)
        if aborted:
            self._report(engine, aborted, 0.0, 0)

    def _report(
        self, engine: LLMEngine, outputs: list[RequestOutput], wall_s: float, failed: int
    ) -> None:
        if self._on_step is not None:
            self._on_step(StepReport(engine.stats(), outputs, wall_s, failed))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        streams, interval = self._state.streams, self.stream_interval
        for out in outputs:
            route = streams.get(out.request_id)
            if route is None:
                continue
            items: list[Any] = []
            if out.finished:
                del streams[out.request_id]
                if out.finish_reason == "error":  # what it made before, then the error
                    items = [*route.take(), RequestFailedError(out.error or "the request failed")]
                else:
                    route.hold(out)
                    items = route.take()
            else:
                route.hold(out)
                tokens = route.held_tokens
                due = interval == 1 or tokens >= interval or (tokens and not route.token_sent)
                if due and not route.final_only:
                    items = route.take()
            if items:
                by_loop.setdefault(route.loop, []).extend((route.queue, i) for i in items)
        for loop, batch in by_loop.items():
            _post(loop, batch)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        route = self._state.streams.pop(request_id, None)
        if route is not None:
            _post(route.loop, [(route.queue, item) for item in [*route.take(), error]])

    def _fail_all(self, error: BaseException) -> None:
        for rid in list(self._state.streams):
            self._deliver_error(rid, error)

    def _die(self, message: str) -> None:
        self._state.status, self._state.error = "dead", message
        self._fail_all(EngineDeadError(message))
        while self._commands:  # adds that arrived meanwhile
            command = self._commands.popleft()
            if isinstance(command, _Add) and not command.accepted.done():
                command.accepted.set_exception(EngineDeadError(message))


def _post(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    def put() -> None:
        for queue, item in items:
            queue.put_nowait(item)

    with contextlib.suppress(RuntimeError):  # the caller's loop closed: nobody listens
        loop.call_soon_threadsafe(put)
