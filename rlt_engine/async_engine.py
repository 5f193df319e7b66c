"""AsyncEngine: asyncio callers stream the outputs of an `LLMEngine` that one owner steps.

The owner runs `engine_core.run_core`: on a thread of this process, or (`engine_process=True`,
as `rlt serve` runs it) in a process of its own, so that the engine's host work never waits
for this process's interpreter lock. Callers send it commands (add, abort) that it drains
between steps, and get their outputs back through their own asyncio queue: after each step
the delivering thread (the engine thread, or the thread that reads the engine process's
events) hands the whole step's outputs, and its answers to adds, to each caller's event loop
in one `call_soon_threadsafe` (`_Posts`), so the engine never waits on a client, however
slow, and a caller's loop wakes once a step however many of its requests it touched.

Faults stay where they happen: a bad request is refused at add (the caller gets the
`ValueError`); a request whose detokenizer or stop matching fails finishes alone with
finish_reason "error" (see `LLMEngine.step`); a failed worker step fails only the requests it
carried (`StepFailedError`); only an error outside those (or the engine process dying) marks
the engine dead, and then every open stream gets `EngineDeadError` and `/health` says 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.process
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlt_engine.engine_core import (
    AbortRequest,
    AddRequest,
    Command,
    CoreFailed,
    CoreReady,
    CoreStopped,
    CoreTurn,
    Event,
    Inbox,
    StopCore,
    run_core,
)
from rlt_engine.engine_info import EngineInfo
from rlt_engine.engine_process import PromptIds, client_pipes, engine_main
from rlt_engine.outputs import RequestOutput
from rlt_engine.sampling_params import SamplingParams
from rlt_engine.structured import GrammarError

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from rlt_engine.engine import LLMEngine
    from rlt_engine.outputs import EngineStats


class EngineDeadError(RuntimeError):
    """The engine stopped on an unexpected error (or its process died); nothing more runs."""


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
            self._engine._send(AbortRequest(self.request_id))


@dataclass
class _Add:
    """An add the core has not answered yet: where its answer and outputs go."""

    accepted: asyncio.Future[None]  # of the caller's loop, answered through `_Posts`
    loop: asyncio.AbstractEventLoop
    stream: RequestStream
    final_only: bool = False


@dataclass
class StepReport:
    """What the engine did in one turn, for metrics: read on the thread that delivers."""

    stats: EngineStats | None  # None: another API server of the engine counts the engine
    outputs: list[RequestOutput]
    wall_s: float | None  # the step's wall time; None: no step ran (aborts only, or ready)
    failed: tuple[str, ...] = ()  # requests failed by the step (no final output comes)


@dataclass
class _Route:
    """Where a request's outputs go, and what the delivering thread holds back for it."""

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
        engine_process: bool = False,
    ) -> None:
        """`stream_interval`: tokens a request's outputs gather before they go to the caller
        as one (the output with its first token, and its last, go at once).
        `engine_process`: run the engine in a process of its own (`make_engine` must then
        pickle: a module-level function or a `functools.partial` of one), not on a thread."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self._make_engine, self._on_step = make_engine, on_step
        self.stream_interval = stream_interval
        self.engine_process = engine_process
        self._inbox = Inbox()  # the engine thread's (thread mode)
        self._commands: Connection | None = None  # the engine process's pipe (process mode)
        self._send_lock = threading.Lock()
        self.process: multiprocessing.process.BaseProcess | None = None
        self._lock = threading.Lock()  # the pending adds and the status, between threads
        self._pending: dict[str, _Add] = {}
        self._stopping = False
        self._state = _State()
        self._loaded = threading.Event()
        self.engine: LLMEngine | None = None  # thread mode: the engine the thread owns
        self._info: EngineInfo | None = None
        self._tokenizer: Any = None
        self._thread: threading.Thread | None = None
        self._prompts = PromptIds()  # process mode: prompt ids sent once per request
        self._attached: tuple[Connection, Connection] | None = None

    @classmethod
    def attach(
        cls,
        commands: Connection,
        events: Connection,
        *,
        on_step: Callable[[StepReport], None] | None = None,
        stream_interval: int = 1,
    ) -> AsyncEngine:
        """A client of an engine process that another process started and owns (one of the
        API servers of `rlt serve --api-server-count N`), over its pipe ends."""
        engine = cls(_started_elsewhere, on_step=on_step, stream_interval=stream_interval)
        engine.engine_process, engine._attached = True, (commands, events)
        return engine

    # -- lifecycle (any thread) -----------------------------------------------------------
    def start(self) -> None:
        """Start the engine (its model loads there) and return at once."""
        if not self.engine_process:
            args = (self._make_engine, self._inbox, self._on_event, self._on_loaded)
            self._thread = threading.Thread(target=run_core, args=args, name="rlt-engine")
        elif self._attached is not None:
            self._commands, events = self._attached
            self._thread = threading.Thread(
                target=self._receive, args=(events,), name="rlt-engine-events"
            )
        else:
            # spawn, not fork: CUDA cannot be used in a forked child, and the child must not
            # inherit the server's sockets and threads
            ctx = multiprocessing.get_context("spawn")
            ([engine_end], [(self._commands, events_out)]) = client_pipes(ctx, 1)
            self.process = ctx.Process(
                target=engine_main,
                args=(self._make_engine, [engine_end]),
                name="rlt-engine",
                daemon=True,  # never outlives the server
            )
            self.process.start()
            for end in engine_end:  # the child's: its exit then reads as EOF here
                end.close()
            self._thread = threading.Thread(
                target=self._receive, args=(events_out,), name="rlt-engine-events"
            )
        self._thread.daemon = True
        self._thread.start()

    @property
    def attached(self) -> bool:
        """A client of an engine process owned elsewhere (see `attach`)."""
        return self._attached is not None

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._loaded.wait(timeout)
        return self._state.status == "ready"

    @property
    def status(self) -> str:
        return self._state.status

    @property
    def error(self) -> str | None:
        return self._state.error

    @property
    def info(self) -> EngineInfo | None:
        """What the loaded engine is (None while loading)."""
        return self._info

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (None for a model without one, or while loading)."""
        return self._tokenizer

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop after the requests still running finish (or `timeout`); abort what is left."""
        with self._lock:
            self._stopping = True
        self._send(StopCore())
        if self._attached is not None:  # the engine stops with its last client, not this one
            with self._send_lock:
                self._attached[0].close()
            self._stopped()
            return
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
        if self.process is not None:
            self.process.join(5.0)
            if self.process.is_alive():  # past the timeout: requests still running
                self.process.kill()
                self.process.join()
            if self._thread is not None:
                self._thread.join(5.0)
            self._stopped()
            with self._send_lock:
                assert self._commands is not None
                self._commands.close()

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
        one output, the finished one (a caller that wants no deltas: the delivering thread
        keeps them and the caller's loop is woken once)."""
        (stream,) = await self.add_all([(prompt, params, request_id)], final_only=final_only)
        return stream

    async def add_all(
        self,
        requests: list[tuple[str | list[int], SamplingParams, str]],
        *,
        final_only: bool = False,
    ) -> list[RequestStream]:
        """`add` for (prompt, params, request id) triples at once: the engine takes them all
        on one turn (`n` choices, a list of prompts), not one a turn. If one is refused (or
        the caller is cancelled), those it took are aborted and the error raised."""
        loop = asyncio.get_running_loop()
        streams = [RequestStream(self, rid) for _, _, rid in requests]
        futures: list[asyncio.Future[None]] = []
        with self._lock:
            self._check_accepting()
            ids = [rid for _, _, rid in requests]
            taken = [rid for rid in ids if rid in self._pending]
            if taken or len(set(ids)) < len(ids):
                raise ValueError(f"request id {(taken or ids)[0]!r} is already in use")
            for stream in streams:
                futures.append(loop.create_future())
                self._pending[stream.request_id] = _Add(futures[-1], loop, stream, final_only)
        self._send([AddRequest(rid, prompt, params) for prompt, params, rid in requests])
        try:
            await asyncio.gather(*futures)
        except BaseException:
            for stream, future in zip(streams, futures, strict=True):
                refused = future.done() and not future.cancelled() and future.exception()
                if refused:  # the core holds nothing of it (and its id may be another's)
                    stream.done = True
                else:  # taken, or not answered yet (cancelled): never let it run
                    stream.abort()
            raise
        return streams

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

    def _send(self, command: Command | list[Command]) -> None:
        if self._commands is None:
            self._inbox.put(command)
            return
        # a closed pipe: the engine process is gone, and the events thread reports it
        with self._send_lock, contextlib.suppress(OSError):
            self._commands.send(command)

    # -- events from the core (the engine thread, or the events thread of process mode) --
    def _on_loaded(self, engine: LLMEngine) -> None:
        self.engine, self._tokenizer = engine, engine.tokenizer

    def _receive(self, events: Connection) -> None:
        message = None
        try:
            while True:
                try:
                    event = events.recv()
                except (EOFError, OSError):
                    break
                self._on_event(event)
        except Exception as exc:  # a bug on this side: nothing would deliver any more
            message = f"the server stopped reading the engine: {type(exc).__name__}: {exc}"
            self._send(StopCore(now=True))
        finally:
            events.close()
        if self._state.status not in ("loading", "ready"):
            return
        if message is None and self._stopping:
            return self._stopped()
        if message is None and self.process is None:
            message = "the engine process went away"
        elif message is None:
            self.process.join(5.0)
            message = f"the engine process exited unexpectedly (exit code {self.process.exitcode})"
        self._finish("dead", message, EngineDeadError(message))

    def _on_event(self, event: Event) -> None:
        if isinstance(event, CoreTurn):
            self._on_turn(event)
        elif isinstance(event, CoreReady):
            self._ready(event.info)
        elif isinstance(event, CoreFailed):
            self._finish("dead", event.message, EngineDeadError(event.message))
        elif isinstance(event, CoreStopped):
            self._stopped()

    def _ready(self, info: EngineInfo) -> None:
        if self.engine_process and info.has_tokenizer:
            from rlt_engine.models.tokenizer import load_tokenizer

            try:  # the server's own copy: chat templates and logprob tokens are rendered here
                self._tokenizer = load_tokenizer(info.model_dir)
            except Exception as exc:
                self._send(StopCore(now=True))
                message = f"model failed to load: {exc}"
                self._finish("dead", message, EngineDeadError(message))
                return
        self._info = info
        self._state.status = "ready"
        self._loaded.set()

    def _on_turn(self, turn: CoreTurn) -> None:
        if self.engine_process:
            self._prompts.restore(turn)
        posts = _Posts()
        streams = self._state.streams
        for rid in turn.accepted:
            with self._lock:
                add = self._pending.pop(rid, None)
            if add is None or add.accepted.done():
                continue  # cancelled while queued: its abort follows
            streams[rid] = _Route(add.loop, add.stream.queue, add.final_only)
            posts.add(add.loop, add.accepted, None)
        for rid, kind, message in turn.refused:
            with self._lock:
                add = self._pending.pop(rid, None)
            if add is not None:
                known = {
                    "ValueError": ValueError,
                    "GrammarError": GrammarError,
                    "EngineDeadError": EngineDeadError,
                }.get(kind)
                error = known(message) if known else RequestFailedError(f"{kind}: {message}")
                posts.add(add.loop, add.accepted, error)
        for rid, message in turn.failed:
            self._deliver_error(rid, RequestFailedError(message), posts)
        self._deliver(turn.outputs, posts)
        posts.send()
        if self._on_step is not None and (turn.stats is not None or turn.outputs or turn.failed):
            failed = tuple(rid for rid, _ in turn.failed)
            self._on_step(StepReport(turn.stats, turn.outputs, turn.wall_s, failed))

    def _deliver(self, outputs: list[RequestOutput], posts: _Posts) -> None:
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
            for item in items:
                posts.add(route.loop, route.queue, item)

    def _deliver_error(self, request_id: str, error: BaseException, posts: _Posts) -> None:
        route = self._state.streams.pop(request_id, None)
        if route is not None:
            for item in [*route.take(), error]:
                posts.add(route.loop, route.queue, item)

    def _stopped(self) -> None:
        """The engine stopped as asked (a no-op if it already ended)."""
        if self._state.status not in ("dead", "stopped"):
            self._finish("stopped", None, EngineDeadError("the engine stopped"))

    def _finish(self, status: str, message: str | None, error: BaseException) -> None:
        """The engine is gone (dead, or stopped): every open stream and waiting add gets
        `error`; nothing more is accepted."""
        with self._lock:
            self._state.status, self._state.error = status, message
            pending, self._pending = self._pending, {}
        self._loaded.set()
        posts = _Posts()
        for add in pending.values():
            posts.add(add.loop, add.accepted, error)
        for rid in list(self._state.streams):
            self._deliver_error(rid, error, posts)
        posts.send()


class _Posts:
    """What one turn hands to callers' event loops, in order, one wake-up per loop: items for
    streams' queues, and answers to adds (a result, or an error to raise)."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any]]] = {}

    def add(
        self,
        loop: asyncio.AbstractEventLoop,
        target: asyncio.Queue[Any] | asyncio.Future[None],
        item: Any,
    ) -> None:
        self._by_loop.setdefault(loop, []).append((target, item))

    def send(self) -> None:
        for loop, items in self._by_loop.items():
            with contextlib.suppress(RuntimeError):  # the caller's loop closed: nobody listens
                loop.call_soon_threadsafe(_put, items)


def _put(items: list[tuple[Any, Any]]) -> None:
    """On the caller's loop: queue each item, or answer each add (unless its caller gave up
    waiting: cancelled)."""
    for target, item in items:
        if isinstance(target, asyncio.Queue):
            target.put_nowait(item)
        elif target.done():
            continue
        elif isinstance(item, BaseException):
            target.set_exception(item)
        else:
            target.set_result(item)


def _started_elsewhere() -> LLMEngine:
    raise RuntimeError("an attached AsyncEngine has no engine of its own to build")
