"""Greedy sampling in one Triton launch that a device gate can skip: `argmax_rows(x, gate)`.

torch's greedy path is `logits.float().argmax(-1)`: a copy of the [rows, vocab] logits to fp32
and a reduction, ~14 us per decode traversal on the H200 at c=8 (Ouro's 49k vocabulary), run
in every traversal although at fixed depth in lockstep three traversals in four have no row that
exits (the lm_head already skips its GEMM there, kernels/small_gemm's gate). This kernel reads
the logits in their own dtype (the fp32 conversion is exact and monotone, so the argmax is the
same), one program per row, and returns at once where the gate is zero, leaving the output
undefined (no row needs it then).

Semantics are torch's: the first index of the maximum; a NaN counts as larger than any number
(the first NaN wins). Per lane the program keeps the best value and index over the chunks it
visits in increasing index order, then reduces the lanes. CUDA-graph capturable; launched with
PDL where available (kernels/pdl.py); triton imported lazily (see paged_attention).
"""

from __future__ import annotations

import torch

from rlt_engine.kernels import paged_attention as _pa
from rlt_engine.kernels import pdl as _pdl
from rlt_engine.kernels.paged_attention import supported

__all__ = ["argmax_rows", "supported"]

triton = tl = None  # set by _import_triton(); the kernel's body reads the module global `tl`

BLOCK = 2048  # vocabulary entries per chunk


def argmax_rows(x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [rows]: the argmax of each row of x [rows, V] (float, last dimension contiguous).
    `gate` (one element on x's device): zero skips the work; the output is then undefined."""
    if x.dim() != 2 or x.stride(-1) != 1 or not x.dtype.is_floating_point:
        raise ValueError(f"x must be [rows, V] float with contiguous rows, got {x.dtype} {x.shape}")
    if gate is not None and (gate.numel() != 1 or gate.device != x.device):
        raise ValueError(f"gate must be one element on {x.device}, got {tuple(gate.shape)}")
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0 or vocab == 0:
        return out
    ok, why = supported(x.device)
    if not ok:
        raise RuntimeError(f"Triton argmax cannot run on {x.device}: {why}")
    _import_triton()
    interpret = _pa._interpreter_mode()
    pdl = _pdl.enabled(x.device)
    block = min(BLOCK, triton.next_power_of_2(vocab))
    with _pa._on_device(x.device):
        _pa._kernel(_argmax_kernel, interpret)[(rows,)](
            x,
            out,
            x if gate is None else gate,
            x.stride(0),
            vocab,
            BLOCK=block,
            GATED=gate is not None,
            PDL=pdl,
            num_warps=8,
            **_pdl.launch_options(pdl),
        )
    return out


def _import_triton() -> None:
    global triton, tl
    _pa._import_triton()
    triton, tl = _pa.triton, _pa.tl


def _argmax_kernel(
    x_ptr,
    out_ptr,
    gate_ptr,
    stride_x,
    V,
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
    lanes = tl.arange(0, BLOCK)
    base = x_ptr + row * stride_x
    best = tl.load(base + lanes, mask=lanes < V, other=float("-inf")).to(tl.float32)
    best_i = lanes
    for k0 in range(BLOCK, V, BLOCK):
        idx = k0 + lanes
        v = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        # strictly better (a later equal value never replaces an earlier one); NaN beats all
        better = (v > best) | ((v != v) & (best == best))
        best = tl.where(better, v, best)
        best_i = tl.where(better, idx, best_i)
    nan = best != best
    any_nan = tl.max(nan.to(tl.int32), axis=0) != 0
    top = tl.max(tl.where(nan, float("-inf"), best), axis=0)
    winner = tl.where(any_nan, nan, best == top)
    tl.store(out_ptr + row, tl.min(tl.where(winner, best_i, V), axis=0).to(tl.int64))
