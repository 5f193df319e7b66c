"""The FastAPI app of `rlt serve`: routes, authentication, limits and error bodies.

`build_app` takes an `AsyncEngine` that is not started; the app's lifespan starts it (the
model loads in the engine process while the server already answers `/health` with 503; with
several API servers, each starts taking connections once the engine is ready) and shuts it
down after uvicorn has drained the open requests (SIGTERM: graceful shutdown).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlt_engine import __version__
from rlt_engine.async_engine import AsyncEngine
from rlt_engine.server.config import ServerConfig
from rlt_engine.server.errors import APIError, error_response
from rlt_engine.server.metrics import CONTENT_TYPE, ServerMetrics
from rlt_engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ParamError,
    TokenizeRequest,
)
from rlt_engine.server.serving import InFlight, Serving


def build_app(
    engine: AsyncEngine,
    config: ServerConfig,
    names: list[str],
    metrics: ServerMetrics,
    in_flight: InFlight | None = None,
) -> FastAPI:
    """`in_flight`: the admission count, when several API servers share one."""
    serving = Serving(engine, names, config, in_flight)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if engine.attached:  # one of several API servers on one socket: it takes connections
            # only once its engine is ready, so none lands on it while it still loads
            await asyncio.to_thread(engine.wait_ready)
        yield
        engine.shutdown()

    app = FastAPI(title="rlt", version=__version__, lifespan=lifespan)
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(ParamError)
    async def param_error(request: Request, exc: ParamError) -> JSONResponse:
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request")
        return error_response(400, f"{param}: {message}" if param else message, param)

    @app.get("/health")
    async def health() -> Response:
        if engine.status == "ready":
            return Response(status_code=200)
        message = "the model is loading" if engine.status == "loading" else engine.error
        return error_response(503, message or f"engine {engine.status}")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = engine.info
        extra: dict[str, Any] = {}
        if info is not None:
            extra = {
                "root": info.model_dir,
                "max_model_len": info.max_model_len,
                "num_loops": info.num_loops,
                "default_loop_controls": {
                    "min_loops": info.default_min_loops,
                    "max_loops": info.default_max_loops,
                    "exit_threshold": info.default_exit_threshold,
                },
            }
        data = [
            {"id": name, "object": "model", "created": started, "owned_by": "rlt", **extra}
            for name in names
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        return await serving.chat(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return serving.detokenize(body)

    app.add_middleware(_BodyLimit, limit=config.max_request_bytes)
    if config.api_key is not None:
        app.add_middleware(_ApiKey, key=config.api_key)
    return app


class _ApiKey:
    """`Authorization: Bearer KEY` on /v1/*; /health, /metrics and /version stay open."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                response = error_response(401, "missing or wrong API key (Authorization: Bearer)")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimit:
    """413 for bodies over `limit` bytes: by Content-Length, or (chunked uploads) by reading
    the body up to the limit before the app sees it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                await self._too_large(scope, receive, send)
            else:  # the HTTP server holds the body to its Content-Length
                await self.app(scope, receive, send)
            return
        buffered: list[Message] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            seen += len(message.get("body", b""))
            if seen > self.limit:
                await self._too_large(scope, receive, send)
                return
            buffered.append(message)
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body over {self.limit} bytes"
        await error_response(413, message)(scope, receive, send)
