"""What the engine hands back: each request's outputs, and snapshots of its own state. These
cross the pipe from the engine process to the API servers, so this module imports nothing
heavy: an API server that unpickles a turn must not have to import torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int | None = None  # prompt logprobs: 1 + the tokens more likely than this one


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
    """One request's progress after a step. The `new_*` fields are the delta since this
    request's previous output (what a stream sends); the cumulative fields (`token_ids`,
    `exit_depths`, `text`, `logprobs`) are filled on the final output only (finished=True),
    so a step never copies whole token lists."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_exit_depths: list[int]  # loops run for each new token (the first comes from prefill)
    new_text: str  # text that became final in this step
    new_logprobs: list[TokenLogprob] | None
    num_tokens: int  # output tokens so far
    finished: bool
    finish_reason: str | None  # stop | length | abort | error
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # finish_reason "error": what failed (this request alone)
    # SamplingParams.prompt_logprobs: one per prompt token (None for the first, which has no
    # context), on the first output that carries tokens and on the final one
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @staticmethod
    def merged(deltas: list[RequestOutput]) -> RequestOutput:
        """Consecutive deltas of one request as one: the new tokens, depths, text and logprobs
        of all of them, the prompt logprobs of the first that has them, everything else
        (finished, the cumulative fields of a final output) from the last."""
        last = deltas[-1]
        if len(deltas) == 1:
            return last
        ids = {d.request_id for d in deltas}
        if len(ids) > 1:
            raise ValueError(f"deltas of several requests: {sorted(ids)}")
        logprobs = None
        if any(d.new_logprobs is not None for d in deltas):
            logprobs = [lp for d in deltas for lp in d.new_logprobs or ()]
        prompt = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
        return dataclasses.replace(
            last,
            prompt_logprobs=prompt,
            new_token_ids=[t for d in deltas for t in d.new_token_ids],
            new_exit_depths=[e for d in deltas for e in d.new_exit_depths],
            new_text="".join(d.new_text for d in deltas),
            new_logprobs=logprobs,
        )


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the scheduler and the KV pool (for metrics and `rlt generate -v`)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    blocks_used: int
    blocks_total: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    decode_rows: int  # requests in the latest step's decode window (0: none)
    # CUDA graphs captured since the engine started (start-up's included), and the host
    # seconds they took: one captured on first use stalls every request in flight
    graphs_captured: int = 0
    graph_capture_s: float = 0.0
