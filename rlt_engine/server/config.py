"""`rlt serve`'s own settings (the engine's are `EngineConfig`): one frozen dataclass whose
fields are also the command's flags (`--host`, `--port`, ...)."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # also RLT_API_KEY; None = no authentication
    served_model_name: tuple[str, ...] = ()  # names clients may use; () = the model as given
    max_concurrent_requests: int = 256  # HTTP requests generating at once; more get 429
    request_timeout: float | None = None  # seconds per request; None = no limit
    max_request_bytes: int = 16 * MiB  # request bodies larger than this get 413
    # tokens a streamed request's outputs gather before they go to its handler (the
    # first token and the end leave at once): fewer, larger SSE chunks, less event-loop work
    stream_interval: int = 1
    # API server processes over one socket and one engine process: past ~15,000 streamed
    # tokens a second one event loop is the limit (server/api_servers.py)
    api_server_count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must lie in [0, 65535], got {self.port}")
        if self.max_concurrent_requests < 1:
            raise ValueError(
                f"max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}"
            )
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count must be >= 1, got {self.api_server_count}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
