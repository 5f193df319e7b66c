"""The one contract between scheduler and worker: plain Python values only.

The worker keeps a persistent slot batch on the device (one slot per running request: its
token, hidden state, loop, exit mass, position, block tables, sampling state). A `StepPlan` is
a diff against that state plus the work of one step: prefill chunks (host-planned, every loop)
and a decode window of `decode_traversals` traversals that the worker runs on its own —
exits, lm_head, sampling and the next token's embedding happen on the device. The `StepResult`
returns the token events of the step. Nothing here is a tensor, so the scheduler is tested with
hand-built results and a later process split changes only the transport.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rlt_engine.core.exit_rule import LoopControls
from rlt_engine.sampling_params import SamplingParams

Tables = tuple[tuple[int, ...], ...]  # one block table per KV plane


class Stage(enum.Enum):
    """A request's lifecycle on the host."""

    WAITING = "waiting"
    PREFILL = "prefill"  # prompt chunks traverse every loop, host-planned
    DECODE = "decode"  # owned by the device: loops, exits and sampling happen there
    FINISHED = "finished"


@dataclass(frozen=True)
class SlotInit:
    """A request was admitted into `slot`: create its device state."""

    slot: int
    params: SamplingParams
    seed: int  # counter-based RNG key: samples depend on (seed, token index) only
    controls: LoopControls
    stop_token_ids: tuple[int, ...]
    prompt_len: int
    block_tables: Tables
    # the prompt's token ids where the repetition penalty needs them (otherwise none: a plan
    # carries diffs, not every prompt)
    prompt_token_ids: tuple[int, ...] = ()
    # structured output: the bitmask of its first token (rlt_engine/structured.py); b"" = free
    token_mask: bytes = b""


@dataclass(frozen=True)
class MaskUpdate:
    """Structured output: the bitmask of the next token of the constrained request in `slot`,
    whose row the device holds since its last token; the row runs again with it."""

    slot: int
    mask: bytes


@dataclass(frozen=True)
class BlockAppend:
    """Blocks appended to the tables of `slot` (every plane grows together)."""

    slot: int
    blocks: Tables


@dataclass(frozen=True)
class SwapOut:
    """Preemption: copy the KV of `blocks` (every plane, table order) and the slot's device
    state to host memory as `snapshot`, then release the slot."""

    snapshot: int
    slot: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class SwapIn:
    """Resume: restore `snapshot` into `block_tables` (same count and order) and `slot`."""

    snapshot: int
    slot: int
    block_tables: Tables

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(b for table in self.block_tables for b in table)


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt positions [start, start + len(token_ids)) of one request through every loop.
    `last`: it ends the prompt, so the first output token is sampled and the slot starts
    decoding on the device."""

    request_id: str
    slot: int
    start: int
    token_ids: tuple[int, ...]
    last: bool
    # prompt logprobs: the prompt tokens its rows predict (the one after each), those it has
    # (the last chunk's last row predicts the output); () = none asked for
    logprob_targets: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepPlan:
    """Worker order: swap_outs, slot_frees, snapshot_drops, slot_inits, swap_ins,
    block_appends, mask_updates, then the prefill waves (each wave one batch, waves in
    order), then the decode window over every decoding slot. `wave_rides`: the one wave
    runs inside the first `depth` traversals of the window instead (its first tokens come
    back as the window's events of traversal depth - 1); the window then has at least
    `depth` traversals."""

    swap_outs: tuple[SwapOut, ...] = ()
    slot_frees: tuple[int, ...] = ()
    snapshot_drops: tuple[int, ...] = ()  # snapshots of requests aborted while preempted
    slot_inits: tuple[SlotInit, ...] = ()
    swap_ins: tuple[SwapIn, ...] = ()
    block_appends: tuple[BlockAppend, ...] = ()
    mask_updates: tuple[MaskUpdate, ...] = ()
    prefill: tuple[tuple[PrefillChunk, ...], ...] = ()
    decode_traversals: int = 0
    wave_rides: bool = False
    # The most keys a decode row of the window may attend to (an upper bound). The worker picks
    # attention's launch plan by it: the tables' capacity would take the long-context plan
    # from the first token of every request whose prompt + max_tokens is reserved past it.
    decode_keys: int = 0

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(c.token_ids) for wave in self.prefill for c in wave)

    @property
    def has_work(self) -> bool:
        return bool(self.prefill) or self.decode_traversals > 0


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    rank: int | None = None  # prompt logprobs: 1 + the tokens more likely than this one


@dataclass(frozen=True)
class TokenEvent:
    """`slot` emitted a token that left the loops after `exit_depth` loops."""

    slot: int
    sample: Sample
    exit_depth: int


@dataclass(frozen=True)
class PromptLogprobs:
    """The logprobs of a chunk's `logprob_targets`, in order: prompt tokens start + 1, ..."""

    slot: int
    start: int
    samples: tuple[Sample, ...]


@dataclass(frozen=True)
class StepResult:
    """Token events in emission order (prefill first tokens, then traversal by traversal),
    and the prompt logprobs of the step's chunks that asked for them."""

    events: tuple[TokenEvent, ...] = ()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
