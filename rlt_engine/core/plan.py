"""The one contract between scheduler and worker: plain Python values only.

The scheduler emits a `StepPlan` (one stage batch) and consumes a `StepResult`. Nothing here
is a tensor, so the scheduler is tested with hand-built results and a later process split
changes only the transport.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rlt_engine.sampling_params import SamplingParams


class Stage(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"  # prompt chunk traversing all loops
    PRELUDE = "prelude"  # a sampled token waits to be embedded (fused into its loop-0 row)
    RECURRENT = "recurrent"  # a decode token between loops
    CODA = "coda"  # exited; waits for lm_head + sampling
    FINISHED = "finished"


@dataclass(frozen=True)
class RecurrentRow:
    """`num_tokens` consecutive positions of one request traversing loop `loop` once."""

    request_id: str
    slot: int  # worker-side state index (hidden states, RNG); not the request's identity
    loop: int
    start: int  # first position
    num_tokens: int
    token_ids: tuple[int, ...] | None  # loop 0 only: embed these first (the prelude)
    block_table: tuple[int, ...]  # the plane this loop reads and writes
    sample: bool  # run coda + sampling on the last token after this loop (exit known ahead)


@dataclass(frozen=True)
class CodaRow:
    request_id: str
    slot: int


@dataclass(frozen=True)
class KVCopy:
    """Copy one token's K/V (all layers) from `src` slot to each slot of `dst` (deeper planes)."""

    src: int
    dst: tuple[int, ...]


@dataclass(frozen=True)
class SlotInit:
    slot: int
    params: SamplingParams
    seed: int  # per-request RNG seed: results do not depend on batch composition


@dataclass(frozen=True)
class SwapOut:
    """Preemption: copy the KV of `blocks` (every plane, table order) and the slot's device
    state (hidden states, RNG, sampling params) to host memory as `snapshot`."""

    snapshot: int
    slot: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class SwapIn:
    """Resume: restore `snapshot` into new `blocks` (same count and order) and `slot`."""

    snapshot: int
    slot: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class StepPlan:
    """Worker order: kv_copies, swap_outs, slot_frees, slot_inits, swap_ins, then the rows."""

    stage: Stage  # RECURRENT or CODA
    rows: tuple[RecurrentRow, ...] | tuple[CodaRow, ...]
    kv_copies: tuple[KVCopy, ...] = ()
    swap_outs: tuple[SwapOut, ...] = ()
    slot_frees: tuple[int, ...] = ()
    slot_inits: tuple[SlotInit, ...] = ()
    swap_ins: tuple[SwapIn, ...] = ()
    snapshot_drops: tuple[int, ...] = ()  # snapshots of requests aborted while preempted

    @property
    def num_tokens(self) -> int:
        if self.stage is Stage.CODA:
            return len(self.rows)
        return sum(r.num_tokens for r in self.rows)  # type: ignore[union-attr]


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass(frozen=True)
class StepResult:
    """Aligned with the plan's rows."""

    hazards: tuple[float | None, ...]  # last token's exit hazard (recurrent rows)
    samples: tuple[Sample | None, ...]  # for rows that sampled
