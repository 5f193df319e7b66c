"""Greedy sampling that a device gate can skip: `argmax_rows(x, gate)`.

torch's greedy path is `logits.float().argmax(-1)`: a copy of the [rows, vocab] logits to fp32
and a reduction, ~14 us per decode traversal on the H200 at c=8 (Ouro's 49k vocabulary), run
in every traversal although at fixed depth in lockstep three traversals in four have no row that
exits (the lm_head already skips its GEMM there, kernels/small_gemm's gate). These kernels read
the logits in their own dtype (the fp32 conversion is exact and monotone, so the argmax is the
same) and return at once where the gate is zero, leaving the output undefined (no row needs it
then).

Two launches: each program of the first takes 2 chunks of one row (a [rows, splits] grid) and
writes its best value and index (`argmax_partials`); the second reduces a row's splits. The
decode traversal launches only the first: its advance kernel, one program per row, reduces its
own row's splits (`first_best`), one launch fewer a traversal (kernels/slot_step.py). One
program per row used to walk the whole vocabulary in dependent chunks (24 for Ouro's 49k
vocabulary, 81 for Nanbeige's 166k); the split grid took adaptive exit's share of the loop
savings on the H200 from 87% to 91% at c=8 (benchmarks/results/2026-12-02-exit-copies-h200.md).

Semantics are torch's: the first index of the maximum; a NaN counts as larger than any number
(the first NaN wins). Per lane a program keeps the best value and index over the chunks it
visits in increasing index order, then reduces the lanes; the splits are reduced the same way
(the first index among the best). CUDA-graph capturable; launched with PDL where available
(kernels/pdl.py); triton imported lazily (see paged_attention).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlt_engine.kernels import paged_attention as _pa
from rlt_engine.kernels import pdl as _pdl
from rlt_engine.kernels.paged_attention import supported

__all__ = ["Partials", "argmax_partials", "argmax_rows", "reduce_reference", "supported"]

triton = tl = None  # set by _import_triton(); the kernel's body reads the module global `tl`
first_best = None  # the @jit form of _first_best, set by _import_triton()

BLOCK = 2048  # vocabulary entries per chunk
CHUNKS_PER_SPLIT = 2  # chunks per program of the first launch


class Partials(NamedTuple):
    """Each row's best value and its index in each split of the vocabulary (`argmax_partials`);
    the row's argmax is the first best among them (`reduce_reference`, `first_best`)."""

    best: torch.Tensor  # fp32 [rows, splits]
    index: torch.Tensor  # int32 [rows, splits]


def argmax_rows(x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [rows]: the argmax of each row of x [rows, V] (float, last dimension contiguous).
    `gate` (one element on x's device): zero skips the work; the output is then undefined."""
    partials = argmax_partials(x, gate)
    rows, splits = partials.best.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0 or splits == 0:
        return out
    interpret = _pa._interpreter_mode()
    pdl = _pdl.enabled(x.device)
    gated = gate is not None
    with _pa._on_device(x.device):
        _pa._kernel(_argmax_reduce_kernel, interpret)[(rows,)](
            *partials, out, gate if gated else x, splits,
            BLOCK_S=triton.next_power_of_2(splits), GATED=gated, PDL=pdl, num_warps=1,
            **_pdl.launch_options(pdl),
        )  # fmt: skip
    return out


def argmax_partials(x: torch.Tensor, gate: torch.Tensor | None = None) -> Partials:
    """The first launch of `argmax_rows`: each row's best per split of the vocabulary. `gate`
    as there (a zero gate leaves the partials undefined)."""
    if x.dim() != 2 or x.stride(-1) != 1 or not x.dtype.is_floating_point:
        raise ValueError(f"x must be [rows, V] float with contiguous rows, got {x.dtype} {x.shape}")
    if gate is not None and (gate.numel() != 1 or gate.device != x.device):
        raise ValueError(f"gate must be one element on {x.device}, got {tuple(gate.shape)}")
    rows, vocab = x.shape
    if rows == 0 or vocab == 0:
        empty = torch.empty((rows, 0), device=x.device)
        return Partials(empty, empty.int())
    ok, why = supported(x.device)
    if not ok:
        raise RuntimeError(f"Triton argmax cannot run on {x.device}: {why}")
    _import_triton()
    interpret = _pa._interpreter_mode()
    pdl = _pdl.enabled(x.device)
    block = min(BLOCK, triton.next_power_of_2(vocab))
    split = block * CHUNKS_PER_SPLIT
    splits = triton.cdiv(vocab, split)
    best = torch.empty((rows, splits), dtype=torch.float32, device=x.device)
    best_i = torch.empty((rows, splits), dtype=torch.int32, device=x.device)
    gated = gate is not None
    with _pa._on_device(x.device):
        _pa._kernel(_argmax_split_kernel, interpret)[(rows, splits)](
            x, best, best_i, gate if gated else x, x.stride(0), vocab,
            SPLIT=split, BLOCK=block, GATED=gated, PDL=pdl, num_warps=8,
            **_pdl.launch_options(pdl),
        )  # fmt: skip
    return Partials(best, best_i)


def reduce_reference(partials: Partials) -> torch.Tensor:
    """int64 [rows]: the torch semantics of reducing `partials` (the first index among the
    best values; a NaN beats every number, the first NaN wins)."""
    best, index = partials
    nan = best.isnan()
    any_nan = nan.any(dim=1, keepdim=True)
    top = torch.where(nan, float("-inf"), best).amax(dim=1, keepdim=True)
    winner = torch.where(any_nan, nan, best == top)
    return torch.where(winner, index, 2**31 - 1).amin(dim=1).long()


def _import_triton() -> None:
    global triton, tl, first_best
    _pa._import_triton()
    triton, tl = _pa.triton, _pa.tl
    first_best = _pa._kernel(_first_best, _pa._interpreter_mode())


def _first_best(best, best_i, n):
    """(value, index) of the first best of `best` (NaN beats all; the lowest index among
    equals), `n` an index larger than any of best_i."""
    nan = best != best
    any_nan = tl.max(nan.to(tl.int32), axis=0) != 0
    top = tl.max(tl.where(nan, float("-inf"), best), axis=0)
    winner = tl.where(any_nan, nan, best == top)
    at = tl.min(tl.where(winner, best_i, n), axis=0)
    return tl.where(any_nan, float("nan"), top), at


def _argmax_split_kernel(
    x_ptr,
    best_ptr,  # out: fp32 [rows, splits]
    best_i_ptr,  # out: int32 [rows, splits]
    gate_ptr,
    stride_x,
    V,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
    GATED: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # wait for the previous kernel, then release the next (kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if GATED:  # noqa: SIM102  (a constexpr test, then a runtime one)
        if tl.load(gate_ptr) == 0:
            return
    row = tl.program_id(0).to(tl.int64)
    split, splits = tl.program_id(1), tl.num_programs(1)
    lanes = tl.arange(0, BLOCK)
    base = x_ptr + row * stride_x
    first = split * SPLIT
    best = tl.load(base + first + lanes, mask=first + lanes < V, other=float("-inf"))
    best = best.to(tl.float32)
    best_i = first + lanes
    for k0 in tl.static_range(BLOCK, SPLIT, BLOCK):
        idx = first + k0 + lanes
        v = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        # strictly better (a later equal value never replaces an earlier one); NaN beats all
        better = (v > best) | ((v != v) & (best == best))
        best = tl.where(better, v, best)
        best_i = tl.where(better, idx, best_i)
    top, at = first_best(best, best_i, first + SPLIT)
    tl.store(best_ptr + row * splits + split, top)
    tl.store(best_i_ptr + row * splits + split, at)


def _argmax_reduce_kernel(
    best_ptr,
    best_i_ptr,
    out_ptr,
    gate_ptr,
    splits,
    BLOCK_S: tl.constexpr,
    GATED: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # wait for the split kernel, then release the next (kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if GATED:  # noqa: SIM102  (a constexpr test, then a runtime one)
        if tl.load(gate_ptr) == 0:
            return
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    ok = s < splits
    best = tl.load(best_ptr + row * splits + s, mask=ok, other=float("-inf"))
    best_i = tl.load(best_i_ptr + row * splits + s, mask=ok, other=2**31 - 1)
    _, at = first_best(best, best_i, 2**31 - 1)
    tl.store(out_ptr + row, at.to(tl.int64))
