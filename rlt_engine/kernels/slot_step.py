"""A decode traversal's per-row bookkeeping in two or three Triton launches instead of ~50
torch kernels.

Around the layer stack, a traversal prepares each row's inputs, and afterwards decides which
rows exit (the fp32 exit rule), runs the lm_head and the sampler, and advances every row's
state. In torch that is ~50 tiny elementwise, gather and copy kernels per traversal, 1-4 us each
on the H200 and serialised: ~80 us of a ~1.4 ms traversal at c=8. Here:

- `prepare` (one program per row): run = active & ~parked; the layer input (the token's
  embedding row at loop 0, else the hidden state); the row's block table in the plane it reads
  (its loop's, or plane 0 with SHARED KV); the slot its K/V goes to (the trash slot for rows
  that do not run); seq_lens; the position's block and offset (for LAST_EXITED exit copies);
  given the model's RoPE table, the position's cos / sin rows; given the first layer's norm,
  the normalised input (that layer's norm launch, with `norm.normed_row`'s arithmetic); and
  given `max_loops`, the exits of a window in which no row may exit early (those that reach
  max_loops, decided by program 0 before the layer stack) with the lm_head gate. Each of these
  was a launch of its own a traversal.
- `exit_rule` (one program over all rows; windows in which a row may exit early): done =
  loop + 1; exits where done reaches max_loops, or (with a gate hazard) R' = R * (1 - h) in
  fp32 reaches 1 - R' >= threshold at done >= min_loops; only running rows exit. Also writes
  the lm_head gate (one int32: any row exits), which the caller passes to the coda.
- `advance` (one program per row): the token event and depth at the window's row (base +
  step), then token / loop / remaining (R' of a running row, given the hazard) / position /
  generated, the finish test (a stop id, or max_tokens reached) on active, parked (no
  refill) and the hidden state of running rows. The drawn tokens come as tokens, or as
  kernels/argmax's partials (the greedy path), which an exiting row's program reduces
  itself: the argmax's second launch. With `step_up` the last program to take a ticket also
  moves `step` on: one torch launch fewer a traversal, and the next traversal's `prepare`
  follows under PDL instead of after a launch gap (a torch kernel keeps full stream order).

Each has a torch reference (`*_reference`, what worker/decode.py runs off the Triton backend)
with the same arithmetic: integer and boolean logic, and two fp32 operations rounded as torch
rounds them (the product with mul.rn, so the compiler cannot fuse it into the subtraction after
it). Rows are independent except for the gate. CUDA-graph capturable; launched with PDL where
available (kernels/pdl.py). triton is imported lazily (see paged_attention).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from rlt_engine.kernels import argmax as _argmax
from rlt_engine.kernels import norm as _norm
from rlt_engine.kernels import paged_attention as _pa
from rlt_engine.kernels import pdl as _pdl
from rlt_engine.kernels.argmax import Partials
from rlt_engine.kernels.paged_attention import supported

__all__ = [
    "EarlyExit",
    "Events",
    "Prepared",
    "Rows",
    "advance",
    "advance_reference",
    "enabled",
    "exit_rule",
    "exit_rule_reference",
    "prepare",
    "prepare_reference",
    "supported",
]

# set by _import_triton(); the kernels' bodies read the module globals `tl` and the @jit forms
# of the helpers: exits_at (_exits_at), exit_mass (_exit_mass), first_best and normed_row
triton = tl = exits_at = exit_mass = first_best = normed_row = None

# On by default (the GPU suite and the fp32 exact suite passed on the H200 with them, and they
# gained at every concurrency); RLT_SLOT_STEP=0 runs the torch references instead (A/B runs).
_MODE = os.environ.get("RLT_SLOT_STEP", "1")


def enabled() -> bool:
    """Whether the worker runs these kernels (on the Triton backend; any device)."""
    return _MODE != "0"


class Prepared(NamedTuple):
    """A traversal's per-row inputs (see `prepare`)."""

    x: torch.Tensor  # [b, H]: the token's embedding at loop 0, else the hidden state
    tables: torch.Tensor  # [b, width] int32: each row's block table in the plane it reads
    slot_mapping: torch.Tensor  # [b] int64: the slot a running row writes (else trash)
    seq_lens: torch.Tensor  # [b] int32: keys each row attends to (position + 1)
    run: torch.Tensor  # [b] bool: active and not parked
    block: torch.Tensor  # [b] int64: index of the position's block in the tables
    offset: torch.Tensor  # [b] int64: the position's offset in that block
    rope: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin [b, D] (given a RoPE table)
    normed: torch.Tensor | None  # [b, H]: x through the first layer's norm (given the norm)
    exits: torch.Tensor | None  # [b] bool: rows that reach max_loops (given max_loops)
    gate: torch.Tensor | None  # [1] int32 (bool in the reference): any of them (max_loops)


class Rows(NamedTuple):
    """Rows [0, b) of the slot state that `advance` updates in place (views of the worker's
    slot batch; field order = the advance kernel's arguments)."""

    token: torch.Tensor  # [b] int64
    hidden: torch.Tensor  # [b, H], rows contiguous
    loop: torch.Tensor  # [b] int64
    remaining: torch.Tensor  # [b] fp32
    position: torch.Tensor  # [b] int64
    generated: torch.Tensor  # [b] int64
    active: torch.Tensor  # [b] bool
    parked: torch.Tensor  # [b] bool
    max_tokens: torch.Tensor  # [b] int64
    stop_ids: torch.Tensor  # [b, S] int64, rows contiguous (-1 = none)


class EarlyExit(NamedTuple):
    """The inputs of the exit rule's early exit, rows [0, b) (a window in which a row may
    exit before max_loops)."""

    remaining: torch.Tensor  # [b] fp32: the exit mass R before this loop
    hazard: torch.Tensor  # [b] fp32: this loop's exit hazard h
    min_loops: torch.Tensor  # [b] int64
    threshold: torch.Tensor  # [b] fp32 (a threshold of 1 is stored as 2: never early)


class Events(NamedTuple):
    """A decode window's token and depth event buffers and its row counter."""

    token: torch.Tensor  # [rows, >= b] int64
    depth: torch.Tensor  # [rows, >= b] int64
    step: torch.Tensor  # [1] int64: the traversal's index in its window
    base: torch.Tensor  # [1] int64: the window's first row (a traversal writes row base + step)
    ticket: torch.Tensor  # [1] int32, zero between launches: `advance`'s programs done with step


def prepare_reference(
    loop: torch.Tensor,
    position: torch.Tensor,
    active: torch.Tensor,
    parked: torch.Tensor,
    token: torch.Tensor,
    embedding: torch.Tensor,
    hidden: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    trash_slot: int,
    shared: bool,
    rope_table: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    max_loops: torch.Tensor | None = None,
) -> Prepared:
    """The torch semantics of `prepare` (any device)."""
    b, width = loop.shape[0], block_tables.shape[2]
    run = active & ~parked
    x = torch.where((loop == 0)[:, None], embedding[token], hidden)
    rope = None
    if rope_table is not None:  # positions past the table (idle rows only) read zeros
        inside = position < rope_table.shape[0]
        rows = rope_table[position.clamp(max=rope_table.shape[0] - 1)]
        rope = torch.where(inside[:, None, None], rows, 0).unbind(1)
    plane = torch.zeros_like(loop) if shared else loop
    tables = block_tables.gather(1, plane[:, None, None].expand(b, 1, width))[:, 0]
    # an idle row's position may sit one past its tables (its last token never runs):
    # clamp so the gather stays in bounds; such rows write only the trash slot
    block, offset = (position // block_size).clamp(max=width - 1), position % block_size
    own = tables.gather(1, block[:, None])[:, 0].long() * block_size + offset
    slot_mapping = torch.where(run, own, trash_slot)
    seq_lens = (position + 1).to(torch.int32)
    normed = None if norm is None else _norm.rms_norm_reference(x, *norm)
    exits = gate = None
    if max_loops is not None:
        exits, gate = exit_rule_reference(loop, active, parked, max_loops)
    return Prepared(
        x, tables, slot_mapping, seq_lens, run, block, offset, rope, normed, exits, gate
    )


def prepare(
    loop: torch.Tensor,
    position: torch.Tensor,
    active: torch.Tensor,
    parked: torch.Tensor,
    token: torch.Tensor,
    embedding: torch.Tensor,
    hidden: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    trash_slot: int,
    shared: bool,
    rope_table: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    max_loops: torch.Tensor | None = None,
) -> Prepared:
    """Rows [0, b) of the slot state before a traversal: loop / position / token int64 [b],
    active / parked bool [b], the embedding table [vocab, H] and hidden [b, H] (rows
    contiguous), block_tables int32 [b, planes, width] contiguous; optionally the RoPE table
    [positions, 2, D] (cos, sin rows), the first layer's norm (weight [H], eps) and max_loops
    int64 [b] (the exits of a window without early exits). One program per row; the exits are
    program 0's. `prepare_reference` is the spec."""
    b, width = loop.shape[0], block_tables.shape[2]
    device = loop.device
    rope = None
    if rope_table is not None:
        if rope_table.dim() != 3 or rope_table.shape[1] != 2 or not rope_table.is_contiguous():
            raise ValueError(
                f"rope_table must be [positions, 2, D] contiguous, got {rope_table.shape}"
            )
        rope = torch.empty((b, 2, rope_table.shape[2]), dtype=rope_table.dtype, device=device)
    if norm is not None and (norm[0].shape != hidden.shape[1:] or norm[0].stride(0) != 1):
        raise ValueError(f"the norm's weight must be [{hidden.shape[1]}] contiguous")
    out = Prepared(
        torch.empty_like(hidden),
        torch.empty((b, width), dtype=torch.int32, device=device),
        torch.empty(b, dtype=torch.int64, device=device),
        torch.empty(b, dtype=torch.int32, device=device),
        torch.empty(b, dtype=torch.bool, device=device),
        torch.empty(b, dtype=torch.int64, device=device),
        torch.empty(b, dtype=torch.int64, device=device),
        None if rope is None else rope.unbind(1),
        None if norm is None else torch.empty_like(hidden),
        None if max_loops is None else torch.empty(b, dtype=torch.bool, device=device),
        None if max_loops is None else torch.empty(1, dtype=torch.int32, device=device),
    )
    if b == 0:
        return out
    if not block_tables.is_contiguous() or embedding.stride(-1) != 1 or hidden.stride(-1) != 1:
        raise ValueError("block_tables must be contiguous; embedding and hidden rows too")
    if embedding.shape[1] != hidden.shape[1] or embedding.dtype != hidden.dtype:
        raise ValueError("the embedding table must match hidden's width and dtype")
    interpret, pdl = _ready(device)
    rope_args = (
        (hidden, hidden, 0, 0)
        if rope is None
        else (rope_table, rope, rope_table.shape[0], rope.shape[2])
    )
    block_h = triton.next_power_of_2(hidden.shape[1])
    with _pa._on_device(device):
        _pa._kernel(_prepare_kernel, interpret)[(b,)](
            loop,
            position,
            active,
            parked,
            token,
            embedding,
            hidden,
            block_tables,
            *out[:7],  # the outputs up to rope, whose [b, 2, D] buffer rope_args carries
            *rope_args,
            hidden if norm is None else norm[0],
            hidden if norm is None else out.normed,
            0.0 if norm is None else float(norm[1]),
            loop if max_loops is None else max_loops,
            loop if max_loops is None else out.exits,
            loop if max_loops is None else out.gate,
            b,
            embedding.stride(0),
            hidden.stride(0),
            block_tables.stride(0),
            block_tables.stride(1),
            hidden.shape[1],
            width,
            block_size,
            trash_slot,
            BLOCK_H=block_h,
            BLOCK_W=min(1024, triton.next_power_of_2(width)),
            BLOCK_D=triton.next_power_of_2(max(1, rope_args[3])),
            BLOCK_B=_rows_block(b),
            INV_H=1.0 / hidden.shape[1],
            ROPE=rope is not None,
            NORM=norm is not None,
            EXITS=max_loops is not None,
            SHARED=shared,
            EXACT_MUL=not interpret,
            ROUND_BF16=interpret and hidden.dtype == torch.bfloat16,
            PDL=pdl,
            # the norm's fp32 sum follows the warps: the same tree as the norm kernel's
            num_warps=_norm.num_warps_for(block_h) if norm is not None else 4,
            **_pdl.launch_options(pdl),
        )
    return out


def exit_rule_reference(
    loop: torch.Tensor,
    active: torch.Tensor,
    parked: torch.Tensor,
    max_loops: torch.Tensor,
    early: EarlyExit | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch semantics of `exit_rule` (any device); the gate is a bool tensor."""
    run = active & ~parked
    done = loop + 1
    exits = done >= max_loops
    if early is not None:
        # f32 exactly as ExitTracker: R' = R * (1 - h); exit when 1 - R' >= threshold
        remaining = exit_mass_reference(early.remaining, early.hazard)
        exits = exits | (done >= early.min_loops) & (1.0 - remaining >= early.threshold)
    exits = exits & run
    return exits, exits.any()


def exit_mass_reference(remaining: torch.Tensor, hazard: torch.Tensor) -> torch.Tensor:
    """R' = R * (1 - h) in fp32: the exit mass after a loop with hazard h."""
    return remaining * (1.0 - hazard)


def advance_reference(
    exits: torch.Tensor,
    drawn: torch.Tensor | Partials,
    hazard: torch.Tensor | None,
    new_hidden: torch.Tensor,
    rows: Rows,
    events: Events,
    refill: bool,
    step_up: bool = False,
) -> None:
    """The torch semantics of `advance` (any device), in place."""
    r, b = rows, exits.shape[0]
    if isinstance(drawn, Partials):
        drawn = _argmax.reduce_reference(drawn)
    run = r.active & ~r.parked
    done = r.loop + 1
    row = events.base + events.step
    events.token[:, :b].index_copy_(0, row, torch.where(exits, drawn, -1)[None])
    events.depth[:, :b].index_copy_(0, row, done[None])
    r.hidden.copy_(torch.where(run[:, None], new_hidden, r.hidden))
    r.token.copy_(torch.where(exits, drawn, r.token))
    r.loop.copy_(torch.where(exits, 0, torch.where(run, done, r.loop)))
    if hazard is not None:
        r.remaining.copy_(torch.where(run, exit_mass_reference(r.remaining, hazard), r.remaining))
    r.remaining.masked_fill_(exits, 1.0)
    r.position.add_(exits)
    r.generated.add_(exits)
    # the host's rule (Scheduler._accept_token): a stop id, or max_tokens reached
    stopped = (drawn[:, None] == r.stop_ids).any(dim=1)
    r.active.logical_and_(~(exits & (stopped | (r.generated >= r.max_tokens))))
    if not refill:
        r.parked.logical_or_(exits)
    if step_up:
        events.step.add_(1)


def exit_rule(
    loop: torch.Tensor,
    active: torch.Tensor,
    parked: torch.Tensor,
    max_loops: torch.Tensor,
    early: EarlyExit | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [0, b) of the slot state (loop, max_loops int64; active, parked bool; `early`'s
    fields as documented there). Returns (exits bool [b], gate int32 [1]: 1 if any row
    exits)."""
    b = loop.shape[0]
    device = loop.device
    exits = torch.empty(b, dtype=torch.bool, device=device)
    gate = torch.empty(1, dtype=torch.int32, device=device)
    interpret, pdl = _ready(device)
    e = early if early is not None else EarlyExit(loop, loop, loop, loop)  # unread
    with _pa._on_device(device):
        _pa._kernel(_exit_rule_kernel, interpret)[(1,)](
            loop,
            active,
            parked,
            max_loops,
            *e,
            exits,
            gate,
            b,
            BLOCK=_rows_block(b),
            EARLY=early is not None,
            EXACT_MUL=not interpret,
            PDL=pdl,
            num_warps=4,
            **_pdl.launch_options(pdl),
        )
    return exits, gate


def advance(
    exits: torch.Tensor,
    drawn: torch.Tensor | Partials,
    hazard: torch.Tensor | None,
    new_hidden: torch.Tensor,
    rows: Rows,
    events: Events,
    refill: bool,
    step_up: bool = False,
) -> None:
    """Advance `rows` in place after sampling (see the module docstring) and write this
    traversal's token and depth events; with `step_up`, then move `events.step` on by one.
    exits [b] bool, drawn: the sampled tokens int64 [b] or kernels/argmax's partials of the
    greedy draws (reduced here, for the rows that exit), hazard fp32 [b] or None (the exit
    mass of running rows then stays), new_hidden [b, H] (the traversal's output)."""
    b, width = rows.hidden.shape
    if b == 0:
        if step_up:
            events.step.add_(1)
        return
    if new_hidden.stride(-1) != 1:
        new_hidden = new_hidden.contiguous()
    partials = isinstance(drawn, Partials)
    splits = drawn.best.shape[1] if partials else 0
    drawn_args = (*drawn, splits) if partials else (drawn, drawn, 0)
    interpret, pdl = _ready(rows.hidden.device)
    with _pa._on_device(rows.hidden.device):
        _pa._kernel(_advance_kernel, interpret)[(b,)](
            exits,
            *drawn_args,
            rows.remaining if hazard is None else hazard,
            new_hidden,
            *rows,
            *events,
            b,
            new_hidden.stride(0),
            rows.hidden.stride(0),
            rows.stop_ids.stride(0),
            events.token.stride(0),
            events.depth.stride(0),
            width,
            rows.stop_ids.shape[1],
            BLOCK_H=triton.next_power_of_2(width),
            BLOCK_S=max(2, triton.next_power_of_2(rows.stop_ids.shape[1])),
            BLOCK_SPLITS=triton.next_power_of_2(splits) if partials else 0,
            HAS_HAZARD=hazard is not None,
            EXACT_MUL=not interpret,
            REFILL=refill,
            STEP_UP=step_up,
            PDL=pdl,
            num_warps=4,
            **_pdl.launch_options(pdl),
        )


def _rows_block(b: int) -> int:
    """The vector width of a program that reads all b rows (the exit rule's)."""
    return max(16, triton.next_power_of_2(b))


def _ready(device: torch.device) -> tuple[bool, bool]:
    ok, why = supported(device)
    if not ok:
        raise RuntimeError(f"Triton slot step cannot run on {device}: {why}")
    _import_triton()
    return _pa._interpreter_mode(), _pdl.enabled(device)


def _import_triton() -> None:
    global triton, tl, exits_at, exit_mass, first_best, normed_row
    _argmax._import_triton()
    _norm._import_triton()
    triton, tl = _pa.triton, _pa.tl
    first_best, normed_row = _argmax.first_best, _norm.normed_row
    interpret = _pa._interpreter_mode()
    exits_at, exit_mass = _pa._kernel(_exits_at, interpret), _pa._kernel(_exit_mass, interpret)


# ----------------------------------------------------------------------------------------------
# Kernels (plain functions; see paged_attention._kernel). Annotations are strings (future
# import), which triton reads as constexpr markers, so defining them needs no triton.


def _exits_at(loop_ptr, active_ptr, parked_ptr, max_loops_ptr, rows, ok):
    """(exits at max_loops, done = loop + 1, run) of `rows` where `ok` (else not exiting, not
    running): the exit rule without its early exit."""
    run = (tl.load(active_ptr + rows, mask=ok, other=0) != 0) & (
        tl.load(parked_ptr + rows, mask=ok, other=1) == 0
    )
    done = tl.load(loop_ptr + rows, mask=ok, other=0) + 1
    exits = done >= tl.load(max_loops_ptr + rows, mask=ok, other=1)
    return exits & run & ok, done, run & ok


def _exit_mass(remaining, hazard, EXACT_MUL: tl.constexpr):
    """R' = R * (1 - h) in fp32 as torch rounds it (`exit_mass_reference`)."""
    keep = 1.0 - hazard
    if EXACT_MUL:  # torch rounds the product before the subtraction that uses it: no FMA
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [remaining, keep], dtype=tl.float32,
            is_pure=True, pack=1,
        )  # fmt: skip
    return remaining * keep


def _exit_rule_kernel(
    loop_ptr,
    active_ptr,
    parked_ptr,
    max_loops_ptr,
    remaining_ptr,  # EARLY: EarlyExit's fields
    hazard_ptr,
    min_loops_ptr,
    threshold_ptr,
    exits_ptr,  # out: bool [b]
    gate_ptr,  # out: int32 [1]
    b,
    BLOCK: tl.constexpr,
    EARLY: tl.constexpr,
    EXACT_MUL: tl.constexpr,  # mul.rn (no FMA contraction); False in the interpreter
    PDL: tl.constexpr,
):
    if PDL:  # wait for the previous kernel, then release the next (kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.arange(0, BLOCK)
    ok = rows < b
    exits, done, run = exits_at(loop_ptr, active_ptr, parked_ptr, max_loops_ptr, rows, ok)
    if EARLY:
        # fp32 exactly as ExitTracker: R' = R * (1 - h); exit when 1 - R' >= threshold
        r = exit_mass(
            tl.load(remaining_ptr + rows, mask=ok, other=1.0),
            tl.load(hazard_ptr + rows, mask=ok, other=0.0),
            EXACT_MUL,
        )
        early = done >= tl.load(min_loops_ptr + rows, mask=ok, other=0)
        early = early & (1.0 - r >= tl.load(threshold_ptr + rows, mask=ok, other=2.0))
        exits = exits | (early & run)
    tl.store(exits_ptr + rows, exits, mask=ok)
    tl.store(gate_ptr, tl.max(exits.to(tl.int32), axis=0))


def _advance_kernel(
    exits_ptr,
    drawn_ptr,  # int64 [b] tokens; with BLOCK_SPLITS the partials' best values fp32 [b, splits]
    drawn_i_ptr,  # BLOCK_SPLITS: the partials' indices int32 [b, splits]
    splits,
    hazard_ptr,  # fp32 [b] (HAS_HAZARD)
    new_hidden_ptr,
    token_ptr,
    hidden_ptr,
    loop_ptr,
    remaining_ptr,
    position_ptr,
    generated_ptr,
    active_ptr,
    parked_ptr,
    max_tokens_ptr,
    stop_ids_ptr,
    event_token_ptr,
    event_depth_ptr,
    step_ptr,
    base_ptr,
    ticket_ptr,
    b,
    stride_new_hidden,
    stride_hidden,
    stride_stop,
    stride_event_token,
    stride_event_depth,
    H,
    S,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,  # 0: drawn holds the tokens
    HAS_HAZARD: tl.constexpr,
    EXACT_MUL: tl.constexpr,  # mul.rn (no FMA contraction); False in the interpreter
    REFILL: tl.constexpr,
    STEP_UP: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # wait for the previous kernel, then release the next (kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    # every load first, then the stores: a load after a store cannot move above it (the
    # pointers might alias), so interleaved each would cost a dependent round trip
    exits = tl.load(exits_ptr + row) != 0
    active = tl.load(active_ptr + row) != 0
    parked = tl.load(parked_ptr + row) != 0
    loop = tl.load(loop_ptr + row)
    if BLOCK_SPLITS > 0:  # an exiting row's greedy token: the first best of its splits
        sp = tl.arange(0, BLOCK_SPLITS)
        mine = (sp < splits) & exits
        best = tl.load(drawn_ptr + row * splits + sp, mask=mine, other=float("-inf"))
        best_i = tl.load(drawn_i_ptr + row * splits + sp, mask=mine, other=2**31 - 1)
        _, drawn = first_best(best, best_i, 2**31 - 1)
        drawn = drawn.to(tl.int64)
    else:
        drawn = tl.load(drawn_ptr + row)
    step = tl.load(step_ptr)
    event_row = tl.load(base_ptr) + step
    token = tl.load(token_ptr + row)
    remaining = tl.load(remaining_ptr + row)
    if HAS_HAZARD:
        new_remaining = exit_mass(remaining, tl.load(hazard_ptr + row), EXACT_MUL)
    else:
        new_remaining = remaining
    position = tl.load(position_ptr + row)
    generated = tl.load(generated_ptr + row)
    max_tokens = tl.load(max_tokens_ptr + row)
    s = tl.arange(0, BLOCK_S)
    stops = tl.load(stop_ids_ptr + row * stride_stop + s, mask=s < S, other=-1)
    run = active & ~parked
    cols = tl.arange(0, BLOCK_H)
    mask = (cols < H) & run  # rows that did not run keep their hidden state
    new = tl.load(new_hidden_ptr + row * stride_new_hidden + cols, mask=mask)

    done = loop + 1
    tl.store(event_token_ptr + event_row * stride_event_token + row, tl.where(exits, drawn, -1))
    tl.store(event_depth_ptr + event_row * stride_event_depth + row, done)
    tl.store(token_ptr + row, tl.where(exits, drawn, token))
    tl.store(loop_ptr + row, tl.where(exits, 0, tl.where(run, done, loop)))
    r = tl.where(exits, 1.0, tl.where(run, new_remaining, remaining))
    tl.store(remaining_ptr + row, r)
    emitted = exits.to(tl.int64)  # an exiting row emits its token: one position on
    tl.store(position_ptr + row, position + emitted)
    generated = generated + emitted
    tl.store(generated_ptr + row, generated)
    stopped = tl.max((stops == drawn).to(tl.int32), axis=0) != 0
    finished = exits & (stopped | (generated >= max_tokens))
    tl.store(active_ptr + row, active & ~finished)
    if not REFILL:
        tl.store(parked_ptr + row, parked | exits)
    tl.store(hidden_ptr + row * stride_hidden + cols, new, mask=mask)
    if STEP_UP:  # noqa: SIM102 (a constexpr: no atomic is compiled without it)
        # every program has read step before its ticket (acq_rel): the last one moves it on
        # and leaves the ticket at zero for the next launch
        if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == b - 1:
            tl.store(step_ptr, step + 1)
            tl.store(ticket_ptr, 0)


def _prepare_kernel(
    loop_ptr,
    position_ptr,
    active_ptr,
    parked_ptr,
    token_ptr,
    embedding_ptr,  # [vocab, H]
    hidden_ptr,
    tables_in_ptr,  # [b, planes, width] int32
    x_ptr,  # out [b, H]
    tables_ptr,  # out [b, width] int32
    slot_ptr,  # out [b] int64
    seq_lens_ptr,  # out [b] int32
    run_ptr,  # out [b] bool
    block_ptr,  # out [b] int64
    offset_ptr,  # out [b] int64
    rope_table_ptr,  # [positions, 2, D] (ROPE)
    rope_ptr,  # out [b, 2, D] (ROPE)
    positions,  # rows of the RoPE table
    D,
    norm_w_ptr,  # [H] (NORM)
    normed_ptr,  # out [b, H] (NORM)
    eps,
    max_loops_ptr,  # [b] int64 (EXITS)
    exits_ptr,  # out [b] bool (EXITS)
    gate_ptr,  # out [1] int32 (EXITS)
    b,
    stride_embedding,
    stride_hidden,
    stride_t_row,
    stride_t_plane,
    H,
    width,
    block_size,
    trash_slot,
    BLOCK_H: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
    INV_H: tl.constexpr,  # fp32(1 / H) (NORM: see norm.py)
    ROPE: tl.constexpr,
    NORM: tl.constexpr,
    EXITS: tl.constexpr,
    SHARED: tl.constexpr,
    EXACT_MUL: tl.constexpr,  # mul.rn (no FMA contraction); False in the interpreter
    ROUND_BF16: tl.constexpr,  # round to bf16 by hand (the interpreter's cast truncates)
    PDL: tl.constexpr,
):
    if PDL:  # wait for the previous kernel, then release the next (kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    # the loads first (two dependent rounds: the scalars, then the rows they point to), the
    # stores after them: see _advance_kernel
    loop = tl.load(loop_ptr + row)
    position = tl.load(position_ptr + row)
    run = (tl.load(active_ptr + row) != 0) & (tl.load(parked_ptr + row) == 0)
    token = tl.load(token_ptr + row)
    if EXITS:  # program 0 decides every row's exit (the others' lanes are masked off)
        rows = tl.arange(0, BLOCK_B)
        mine = (rows < b) & (row == 0)
        exits, _, _ = exits_at(loop_ptr, active_ptr, parked_ptr, max_loops_ptr, rows, mine)

    cols = tl.arange(0, BLOCK_H)
    h_ok = cols < H
    fresh = loop == 0  # loop 0 reads its token's embedding, later loops the hidden state
    e = tl.load(embedding_ptr + token * stride_embedding + cols, mask=h_ok & fresh, other=0.0)
    h = tl.load(hidden_ptr + row * stride_hidden + cols, mask=h_ok & ~fresh, other=0.0)
    x = tl.where(fresh, e, h)
    if NORM:  # the first layer's norm, bit for bit as its own launch (norm.normed_row)
        norm_w = tl.load(norm_w_ptr + cols, mask=h_ok, other=0.0).to(tl.float32)
        normed = normed_row(x, norm_w, eps, INV_H, EXACT_MUL, ROUND_BF16).to(x.dtype)
    if ROPE:  # the position's cos and sin rows; past the table (idle rows only) zeros
        d = tl.arange(0, 2 * BLOCK_D)
        part, col = d // BLOCK_D, d % BLOCK_D
        ok = (col < D) & (position < positions)
        cos_sin = tl.load(rope_table_ptr + (position * 2 + part) * D + col, mask=ok, other=0.0)
    plane = 0 if SHARED else loop
    src = tables_in_ptr + row * stride_t_row + plane * stride_t_plane
    block = tl.minimum(position // block_size, width - 1)
    offset = position % block_size
    own = tl.load(src + block).to(tl.int64) * block_size + offset
    w = tl.arange(0, BLOCK_W)
    table = tl.load(src + w, mask=w < width)  # the first BLOCK_W entries (all, mostly)

    tl.store(run_ptr + row, run)
    tl.store(x_ptr + row * H + cols, x, mask=h_ok)
    if NORM:
        tl.store(normed_ptr + row * H + cols, normed, mask=h_ok)
    if ROPE:
        tl.store(rope_ptr + (row * 2 + part) * D + col, cos_sin, mask=col < D)
    tl.store(tables_ptr + row * width + w, table, mask=w < width)
    for w0 in range(BLOCK_W, width, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        tl.store(tables_ptr + row * width + w, tl.load(src + w, mask=w < width), mask=w < width)
    tl.store(slot_ptr + row, tl.where(run, own, trash_slot))
    tl.store(seq_lens_ptr + row, (position + 1).to(tl.int32))
    tl.store(block_ptr + row, block)
    tl.store(offset_ptr + row, offset)
    if EXITS:
        tl.store(exits_ptr + rows, exits, mask=mine)
        if row == 0:
            tl.store(gate_ptr, tl.max(exits.to(tl.int32), axis=0))
