"""`/v1/completions` and `/v1/chat/completions`: requests -> engine requests -> responses.

One HTTP request becomes one engine request per (prompt, choice). All of them are added
before the response starts, so a refused one (prompt too long, ...) is a 400 and leaves
nothing behind; once the response runs, whatever ends it — the last token, the client going
away, a timeout, an error — aborts every engine request still running, so no KV outlives it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from rlt_engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineNotReadyError,
    RequestFailedError,
    RequestStream,
)
from rlt_engine.outputs import RequestOutput, TokenLogprob
from rlt_engine.sampling_params import SamplingParams
from rlt_engine.server.config import ServerConfig
from rlt_engine.server.errors import APIError, error_body
from rlt_engine.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    ParamError,
    TokenizeRequest,
)
from rlt_engine.structured import GrammarError

DISCONNECT_POLL_S = 0.25


@dataclass
class _Job:
    """The engine requests of one HTTP request."""

    id: str
    model: str
    created: int
    streams: list[RequestStream] = field(default_factory=list)
    prompt_tokens: int = 0
    released: bool = False  # its admission slot is given back (once)

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()


class InFlight:
    """HTTP requests generating now, against `--max-concurrent-requests`: a count of this
    process's, or (`shared`, a multiprocessing Value) one count for every API server of an
    engine, so that N servers admit what one would."""

    def __init__(self, limit: int, shared: Any = None) -> None:
        self.limit, self._shared, self._count = limit, shared, 0

    @property
    def count(self) -> int:
        return self._count if self._shared is None else int(self._shared.value)

    def enter(self) -> bool:
        """Take a place; False if all are taken."""
        if self._shared is None:
            if self._count >= self.limit:
                return False
            self._count += 1
            return True
        with self._shared.get_lock():
            if self._shared.value >= self.limit:
                return False
            self._shared.value += 1
            return True

    def leave(self) -> None:
        if self._shared is None:
            self._count -= 1
            return
        with self._shared.get_lock():
            self._shared.value -= 1


class Serving:
    def __init__(
        self,
        engine: AsyncEngine,
        names: list[str],
        config: ServerConfig,
        in_flight: InFlight | None = None,
    ) -> None:
        self.engine, self.names, self.config = engine, names, config
        self.in_flight = in_flight or InFlight(config.max_concurrent_requests)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    # -- entry points -------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self._admit(body.model)
        try:
            body.check()
            prompts = body.prompts()
            max_tokens = body.max_tokens or 16
            work: list[tuple[str | list[int], SamplingParams]] = []
            for prompt in prompts:
                for choice in range(body.n):
                    params = body.sampling_params(
                        max_tokens, body.logprobs, choice, body.scored_prompt
                    )
                    work.append((prompt, params))
            job = await self._start(body.model, "cmpl", work, body.stream, body.grammar_field)
        except BaseException:
            self.in_flight.leave()
            raise
        echo = [self._prompt_text(p) for p in prompts] if body.echo else None
        render = _CompletionRender(self.tokenizer, echo, body.n, body.prompt_logprobs is not None)
        return await self._respond(job, body.stream, body.include_usage, render, request)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Any:
        self._admit(body.model)
        try:
            body.check()
            ids = self._render_chat(
                body.messages, body.add_generation_prompt, body.continue_final_message
            )
            limit = body.token_limit
            if limit is None:  # as vLLM: whatever context the prompt leaves, in the pool too
                assert self.engine.info is not None
                limit = max(1, self.engine.info.max_request_positions - len(ids))
            work = [
                (
                    ids,
                    body.sampling_params(limit, body.logprobs_count, choice, body.prompt_logprobs),
                )
                for choice in range(body.n)
            ]
            job = await self._start(body.model, "chatcmpl", work, body.stream, body.grammar_field)
        except BaseException:
            self.in_flight.leave()
            raise
        render = _ChatRender(self.tokenizer, body.prompt_logprobs is not None)
        return await self._respond(job, body.stream, body.include_usage, render, request)

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """The token ids of a prompt, or of chat messages rendered by the model's template, as
        a completion or a chat request would send them to the engine."""
        self._known(body.model)
        body.check()
        if body.messages is not None:
            ids = self._render_chat(
                body.messages, body.add_generation_prompt, body.continue_final_message
            )
        else:
            assert body.prompt is not None
            ids = self._tokenizer_for("prompt").encode(body.prompt)
        assert self.engine.info is not None
        return {"count": len(ids), "max_model_len": self.engine.info.max_model_len, "tokens": ids}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self._known(body.model)
        tokenizer = self._tokenizer_for("tokens")
        assert self.engine.info is not None
        vocab = self.engine.info.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise ParamError("tokens", f"token ids must lie in [0, {vocab})")
        return {"prompt": tokenizer.decode(body.tokens)}

    def _tokenizer_for(self, field: str) -> Any:
        if self.tokenizer is None:
            raise ParamError(field, "this model has no tokenizer")
        return self.tokenizer

    # -- shared steps -------------------------------------------------------------------
    def _known(self, model: str) -> None:
        """A ready engine serving `model`."""
        if self.engine.status == "loading":
            raise APIError(503, "the model is still loading; retry when /health is 200")
        if self.engine.status != "ready":
            raise APIError(503, self.engine.error or "the engine is not running")
        if model not in self.names:
            raise APIError(404, f"the model {model!r} does not exist", "model")

    def _admit(self, model: str) -> None:
        self._known(model)
        if not self.in_flight.enter():
            raise APIError(
                429,
                f"server busy: {self.in_flight.count} requests in flight "
                f"(--max-concurrent-requests {self.config.max_concurrent_requests})",
                headers={"Retry-After": "1"},
            )

    def _render_chat(
        self, messages: list[ChatMessage], add_generation_prompt: bool, continue_final: bool
    ) -> list[int]:
        """The ids of a chat request's messages (chat completions and /tokenize)."""
        from rlt_engine.models.tokenizer import TokenizerError, render_chat

        if self.tokenizer is None:
            raise ParamError("messages", "this model has no tokenizer, so it has no chat template")
        plain = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(messages)]
        try:
            return render_chat(
                self.tokenizer,
                plain,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final,
            )
        except TokenizerError as exc:
            field = "continue_final_message" if continue_final else "messages"
            raise ParamError(field, str(exc)) from None

    def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(prompt) if self.tokenizer is not None else ""

    async def _start(
        self,
        model: str,
        kind: str,
        work: list[tuple[str | list[int], SamplingParams]],
        stream: bool,
        grammar_field: str | None = None,
    ) -> _Job:
        """`grammar_field`: the body's field that asked for structured output (named by the
        400 of a grammar that does not compile)."""
        assert self.engine.info is not None
        vocab = self.engine.info.vocab_size  # (the engine checks it too, naming no field)
        if any(t >= vocab for _, params in work for t, _ in params.logit_bias):
            raise ParamError("logit_bias", f"logit_bias token ids must lie in [0, {vocab})")
        job = _Job(f"{kind}-{uuid.uuid4().hex}", model, int(time.time()))
        requests = [(prompt, params, f"{job.id}-{i}") for i, (prompt, params) in enumerate(work)]
        try:
            # all choices and prompts on one engine turn; a response sent whole needs no
            # deltas: the delivering thread keeps them
            job.streams = await self.engine.add_all(requests, final_only=not stream)
        except BaseException as exc:
            job.abort()
            if isinstance(exc, GrammarError) and grammar_field is not None:
                raise ParamError(grammar_field, str(exc)) from None
            if isinstance(exc, ValueError):
                raise ParamError("prompt" if kind == "cmpl" else "messages", str(exc)) from None
            if isinstance(exc, EngineNotReadyError | EngineDeadError):
                raise APIError(503, str(exc)) from None
            raise
        return job

    async def _respond(
        self, job: _Job, stream: bool, usage: bool, render: _Render, request: Request
    ) -> Any:
        if stream:
            return _JobStreamingResponse(
                self._events(job, usage, render), on_close=lambda: self._release(job)
            )
        try:
            finals = await self._collect(job, request)
        finally:
            self._release(job)
        return JSONResponse(render.response(job, finals))

    def _release(self, job: _Job) -> None:
        job.abort()
        if not job.released:
            job.released = True
            self.in_flight.leave()

    async def _collect(self, job: _Job, request: Request) -> list[RequestOutput]:
        """Every choice's final output; aborted when the client leaves or time runs out."""
        finals: list[RequestOutput | None] = [None] * len(job.streams)

        async def run() -> None:
            async for index, out in _merged(job.streams):
                if out.finished:
                    finals[index] = out

        task = asyncio.ensure_future(self._timed(run()))
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if task not in done:
            task.cancel()
            job.abort()
            raise APIError(499, "client disconnected")
        exc = task.exception()
        if exc is not None:
            raise _api_error(exc) from exc
        return [f for f in finals if f is not None]

    async def _timed(self, work: Any) -> None:
        try:
            await asyncio.wait_for(work, self.config.request_timeout)
        except TimeoutError:
            raise self._late() from None

    def _late(self) -> APIError:
        return APIError(408, f"the request took longer than {self.config.request_timeout:g} s")

    async def _events(self, job: _Job, usage: bool, render: _Render) -> AsyncIterator[str]:
        deadline = None
        if self.config.request_timeout is not None:
            deadline = time.monotonic() + self.config.request_timeout
        completion_tokens = 0
        for chunk in render.opening(job):
            yield _sse(chunk)
        merged = _merged(job.streams)
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise self._late()
                try:
                    index, out = await asyncio.wait_for(anext(merged), left)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    # the deadline, whatever the clock says now (uvloop's timers may fire a
                    # little early); the wait's cancellation also closed `merged`, whose next
                    # item would read as the end of the stream
                    raise self._late() from None
                completion_tokens += len(out.new_token_ids)
                yield _sse(render.chunk(job, index, out))
        except Exception as exc:  # the stream has started: report in-band, then end it
            job.abort()
            err = _api_error(exc)
            yield _sse(error_body(err.status, err.message, err.param))
            self._release(job)
            yield "data: [DONE]\n\n"
            return
        finally:
            await merged.aclose()
        if usage:
            yield _sse(render.usage_chunk(job, completion_tokens))
        # the slot is free before the client can read the end: a client that sends its next
        # request as soon as it has read [DONE] must not meet its own finished request's slot
        self._release(job)
        yield "data: [DONE]\n\n"


def _api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestFailedError):
        return APIError(500, f"the request failed: {exc}")
    if isinstance(exc, EngineDeadError | EngineNotReadyError):
        return APIError(503, str(exc))
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


class _JobStreamingResponse(StreamingResponse):
    """A streaming response that releases its job however the response ends (finished,
    client gone, cancelled), even if the body iterator never started.

    Its chunks go out from the request's own task, and a task of its own waits for the
    client's disconnect and cancels the stream. Starlette's `StreamingResponse` does the same
    in an anyio task group whose cancellation (anyio formats the task's repr into every
    cancel reason) cost ~70-200 us a request
    (`benchmarks/results/2026-12-05-add-answers-cpu.md`)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.headers["Cache-Control"] = "no-cache"
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        stream = asyncio.current_task()
        assert stream is not None
        ended = gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if not ended:  # never once the response is over: its cleanup runs
                gone = True
                stream.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code,
                 "headers": self.raw_headers}
            )  # fmt: skip
            async for chunk in self.body_iterator:
                body = chunk.encode() if isinstance(chunk, str) else chunk
                await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            if hasattr(stream, "uncancel"):  # Python >= 3.11: this cancel is handled
                stream.uncancel()
        finally:
            ended = True
            watcher.cancel()
            self._on_close()
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:  # stopped at a send, not inside the generator: close it
                await close()


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from all streams as they arrive; errors propagate."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as exc:
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _prompt_tokens(finals: list[RequestOutput], n: int) -> int:
    """Prompt tokens counted once per prompt, not once per choice (as OpenAI counts)."""
    return sum(len(out.prompt_token_ids) for out in finals[::n])


# -- rendering -------------------------------------------------------------------------------
class _Render:
    def opening(self, job: _Job) -> list[dict[str, Any]]:
        return []

    def chunk(self, job: _Job, index: int, out: RequestOutput) -> dict[str, Any]:
        raise NotImplementedError

    def response(self, job: _Job, finals: list[RequestOutput]) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, job: _Job, completion_tokens: int) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionRender(_Render):
    def __init__(
        self, tokenizer: Any, echo: list[str] | None, n: int, prompt_logprobs: bool = False
    ) -> None:
        """`prompt_logprobs`: vLLM's field was given (each choice carries them, the first
        chunk of a stream)."""
        self.tokenizer, self.echo, self.n = tokenizer, echo, n
        self.prompt_logprobs = prompt_logprobs
        self.offsets: dict[int, int] = {}  # choice -> characters of text sent so far
        self.prompts: dict[int, list[int]] = {}

    def _head(self, job: _Job) -> dict[str, Any]:
        return {
            "id": job.id,
            "object": "text_completion",
            "created": job.created,
            "model": job.model,
        }

    def _choice(self, index: int, text: str, out: RequestOutput, new: bool) -> dict[str, Any]:
        lps = out.new_logprobs if new else out.logprobs
        start = self.offsets.get(index, 0)
        logprobs = None
        if lps is not None:
            entries: list[tuple[int, TokenLogprob | None]] = [(lp.token_id, lp) for lp in lps]
            if self.echo is not None and index not in self.offsets:  # the text opens with it
                # (null past what was scored: a choice that ended before its prompt was)
                scored = out.prompt_logprobs or []
                prompt = [
                    (t, scored[i] if i < len(scored) else None)
                    for i, t in enumerate(out.prompt_token_ids)
                ]
                echoed = len(self.echo[index // self.n])
                logprobs = _completion_logprobs(self.tokenizer, prompt, 0)
                rest = _completion_logprobs(self.tokenizer, entries, start + echoed)
                logprobs = {key: logprobs[key] + rest[key] for key in logprobs}
            else:
                logprobs = _completion_logprobs(self.tokenizer, entries, start)
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            **(
                {"prompt_logprobs": _vllm_prompt_logprobs(self.tokenizer, out)}
                if self.prompt_logprobs and index not in self.offsets
                else {}
            ),
            "finish_reason": out.finish_reason if out.finished else None,
            "exit_depths": out.new_exit_depths if new else out.exit_depths,
            "token_ids": out.new_token_ids if new else out.token_ids,
        }
        self.offsets[index] = start + len(text)
        return choice

    def chunk(self, job: _Job, index: int, out: RequestOutput) -> dict[str, Any]:
        self.prompts.setdefault(index, out.prompt_token_ids)
        text = out.new_text
        if self.echo is not None and index not in self.offsets:
            text = self.echo[index // self.n] + text
        return {**self._head(job), "choices": [self._choice(index, text, out, new=True)]}

    def response(self, job: _Job, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for index, out in enumerate(finals):
            text = out.text
            if self.echo is not None:
                text = self.echo[index // self.n] + text
            choices.append(self._choice(index, text, out, new=False))
        completion = sum(out.num_tokens for out in finals)
        usage = _usage(_prompt_tokens(finals, self.n), completion)
        return {**self._head(job), "choices": choices, "usage": usage}

    def usage_chunk(self, job: _Job, completion_tokens: int) -> dict[str, Any]:
        prompt = sum(len(ids) for i, ids in self.prompts.items() if i % self.n == 0)
        return {**self._head(job), "choices": [], "usage": _usage(prompt, completion_tokens)}


class _ChatRender(_Render):
    def __init__(self, tokenizer: Any, prompt_logprobs: bool = False) -> None:
        """`prompt_logprobs`: vLLM's field was given (the response carries them)."""
        self.tokenizer, self.prompt_logprobs = tokenizer, prompt_logprobs
        self.prompt_len = 0

    def _head(self, job: _Job, chunk: bool = True) -> dict[str, Any]:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": job.id, "object": kind, "created": job.created, "model": job.model}

    def opening(self, job: _Job) -> list[dict[str, Any]]:
        return [
            {
                **self._head(job),
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            for i in range(len(job.streams))
        ]

    def chunk(self, job: _Job, index: int, out: RequestOutput) -> dict[str, Any]:
        self.prompt_len = len(out.prompt_token_ids)
        delta = {"content": out.new_text} if out.new_text else {}
        lps = out.new_logprobs
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": _chat_logprobs(self.tokenizer, lps) if lps is not None else None,
            "finish_reason": out.finish_reason if out.finished else None,
            "exit_depths": out.new_exit_depths,
            "token_ids": out.new_token_ids,
        }
        return {**self._head(job), "choices": [choice]}

    def response(self, job: _Job, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = [
            {
                "index": index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": (
                    _chat_logprobs(self.tokenizer, out.logprobs)
                    if out.logprobs is not None
                    else None
                ),
                "finish_reason": out.finish_reason,
                "exit_depths": out.exit_depths,
                "token_ids": out.token_ids,
            }
            for index, out in enumerate(finals)
        ]
        prompt = len(finals[0].prompt_token_ids) if finals else 0
        usage = _usage(prompt, sum(out.num_tokens for out in finals))
        body = {**self._head(job, chunk=False), "choices": choices, "usage": usage}
        if self.prompt_logprobs and finals:  # one prompt for every choice (vLLM's place)
            body["prompt_logprobs"] = _vllm_prompt_logprobs(self.tokenizer, finals[0])
        return body

    def usage_chunk(self, job: _Job, completion_tokens: int) -> dict[str, Any]:
        return {
            **self._head(job),
            "choices": [],
            "usage": _usage(self.prompt_len, completion_tokens),
        }


def _token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def _completion_logprobs(
    tokenizer: Any, entries: list[tuple[int, TokenLogprob | None]], start: int
) -> dict[str, Any]:
    """OpenAI's completion logprobs of (token id, its logprob) entries, text offsets from
    `start`; an echoed prompt's first token has no logprob (null, as OpenAI's)."""
    tokens = [_token_text(tokenizer, token_id) for token_id, _ in entries]
    offsets, at = [], start
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob if lp else None for _, lp in entries],
        "top_logprobs": [
            {_token_text(tokenizer, t): v for t, v in lp.top} if lp else None for _, lp in entries
        ],
        "text_offset": offsets,
    }


def _vllm_prompt_logprobs(tokenizer: Any, out: RequestOutput) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token (None for the first) its own entry and the
    top k's, by token id: logprob, rank, decoded text."""
    if out.prompt_logprobs is None:
        return []
    entries: list[dict[str, Any] | None] = []
    for lp in out.prompt_logprobs:
        if lp is None:
            entries.append(None)
            continue
        entry: dict[str, Any] = {}
        for t, v, rank in [(lp.token_id, lp.logprob, lp.rank)] + [
            (t, v, rank) for rank, (t, v) in enumerate(lp.top, start=1)
        ]:
            text = _token_text(tokenizer, t)
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": text})
        entries.append(entry)
    return entries


def _chat_logprobs(tokenizer: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]
    }
