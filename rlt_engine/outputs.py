"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    exit_depths: list[int]  # loops run for each output token (the first comes from prefill)
    finished: bool
    finish_reason: str | None  # stop | length | abort
    new_text: str  # text completed by the latest step (streaming)
    logprobs: list[TokenLogprob] | None
    metrics: RequestMetrics
