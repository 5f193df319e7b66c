"""A request's host-side state: WAITING -> PREFILL (host-planned chunks) -> DECODE (the device
runs its loops and samples; the host learns each token from the step's events) -> FINISHED."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rlt_engine.core.exit_rule import LoopControls
from rlt_engine.core.plan import Sample, Stage
from rlt_engine.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    controls: LoopControls
    stop_token_ids: frozenset[int]
    seed: int
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = 0  # arrival order, set by the scheduler
    bypassed: int = 0  # times a later arrival was admitted first (bounded under priority)
    # priority, while queued: later arrivals admitted when it joined the queue
    # (`Admission._bypassed` adds those admitted since to `bypassed`)
    bypass_mark: int | None = None
    snapshot: int | None = None  # id of its host snapshot while preempted
    snapshot_tokens: int = 0  # KV positions its tables covered when it was preempted
    num_preemptions: int = 0

    stage: Stage = Stage.WAITING
    slot: int | None = None
    block_tables: list[list[int]] | None = None
    num_prefilled: int = 0  # prompt tokens that finished every loop (or are planned to)
    blocks_sent: int = 0  # blocks per plane the worker's mirror of the tables holds

    output_token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    # prompt logprobs (params.prompt_logprobs): one per prompt token after the first, in order
    prompt_samples: list[Sample] = field(default_factory=list)
    # structured output: the bitmask of its next token, computed by the host after its last
    # one and not yet sent to the device (the next plan's SlotInit or MaskUpdate carries it)
    token_mask: bytes = b""
    # the windows whose results are in: traversals its slot decoded in, and the loops its
    # decode tokens took (their exit depths); the difference is the loops into the current one
    decode_traversals: int = 0
    decode_loops: int = 0
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_positions(self) -> int:
        """KV positions this request can ever write (the last sampled token is never run)."""
        return self.prompt_len + self.params.max_tokens - 1

    @property
    def decode_position(self) -> int:
        """Position of the newest sampled token, the one travelling through the loops."""
        return self.prompt_len + len(self.output_token_ids) - 1

    @property
    def constrained(self) -> bool:
        """Structured output: the device holds its row after each token until the next
        mask."""
        return self.params.structured is not None

    @property
    def finished(self) -> bool:
        return self.stage is Stage.FINISHED
