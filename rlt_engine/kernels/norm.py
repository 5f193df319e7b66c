"""Fused RMSNorm (optionally with the residual add) as one Triton kernel.

`rms_norm(x, weight, eps, residual)` reproduces the rounding steps of `layers.RMSNorm` (and of
`residual + RMSNorm(x)`), which in eager torch is ~8 kernels (cast, pow, mean, add, rsqrt, mul,
cast, mul) plus the add:

    y   = (x32 * rsqrt(mean(x32 ** 2) + eps)).to(x.dtype)       x32 = x.float()
    out = (weight.float() * y.float()).to(x.dtype)               torch's bf16 * bf16
    out = (residual.float() + out.float()).to(x.dtype)           with `residual`: a bf16 add

The only intended difference from torch is the order of the fp32 sum of squares (a fixed tree
per row here), so bf16 outputs differ from torch by at most one rounding step in rare elements,
and fp32 outputs by ~1e-7 relative. Each row is one program reading its row once, in the same
order whatever the batch: the output of a row does not depend on the other rows (batch
invariant). Products that torch rounds separately are computed with `mul.rn` on the GPU so that
the compiler cannot contract them with the following add into an FMA.

CUDA-graph capturable: no host synchronisation, the grid depends only on the shapes.
triton is imported lazily (see paged_attention: the interpreter mode and its workarounds).
"""

from __future__ import annotations

import torch

from rlt_engine.kernels import paged_attention as _pa
from rlt_engine.kernels import pdl as _pdl
from rlt_engine.kernels import rope as _rope
from rlt_engine.kernels.paged_attention import supported

__all__ = ["rms_norm", "rms_norm_reference", "supported"]

# set by _import_triton(); the kernels' bodies read the module globals `tl`, `round_bf16` and
# `normed_row` (the @jit form of _normed_row)
triton = tl = round_bf16 = normed_row = None

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HIDDEN = 65536


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch semantics `rms_norm` reproduces (layers.RMSNorm, then the residual add)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight.float() * x32.to(x.dtype).float()).to(x.dtype)
    return out if residual is None else residual + out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dimension of `x` [..., H] (usually [rows, H]), times `weight` [H];
    with `residual` (same shape and dtype as x) returns `residual + norm(x)`. The result has x's
    dtype (weight may have any float dtype; it is read in fp32). `out` (x's shape and dtype,
    last dimension contiguous) may alias `x` or `residual`: each row is read fully before it is
    written."""
    return _launch(x, weight, eps, residual, out)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    num_warps: int | None = None,
) -> torch.Tensor:
    """`rms_norm` with a tuning override (benchmarks)."""
    if x.dim() < 1 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be a [..., H] tensor of {_DTYPES}, got {x.dtype} {x.shape}")
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or weight.dtype not in _DTYPES or weight.device != x.device:
        raise ValueError(
            f"weight must be [{hidden}] float on {x.device}, got {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}"
        )
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"H must be in [1, {MAX_HIDDEN}], got {hidden}")
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device
    ):
        raise ValueError(
            f"residual must be {tuple(x.shape)} {x.dtype} on {x.device}, got "
            f"{tuple(residual.shape)} {residual.dtype} on {residual.device}"
        )
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out must be {tuple(x.shape)} {x.dtype} on {x.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    x2, out2 = _rows(x), _rows(out)
    if out2 is None or out2.stride(-1) != 1:
        raise ValueError("out must be viewable as [rows, H] with a contiguous last dimension")
    if x2 is None or x2.stride(-1) != 1:
        x2 = x.reshape(-1, hidden).contiguous()
    res2 = None
    if residual is not None:
        res2 = _rows(residual)
        if res2 is None or res2.stride(-1) != 1:
            res2 = residual.reshape(-1, hidden).contiguous()
    if weight.stride(0) != 1:
        weight = weight.contiguous()
    rows = x2.shape[0]
    if rows == 0:
        return out
    ok, why = supported(x.device)
    if not ok:
        raise RuntimeError(f"Triton rms_norm cannot run on {x.device}: {why}")
    _import_triton()
    interpret = _pa._interpreter_mode()

    block = triton.next_power_of_2(hidden)
    if num_warps is None:
        num_warps = num_warps_for(block)
    kernel = _pa._kernel(_rms_norm_kernel, interpret)
    pdl = _pdl.enabled(x.device)
    with _pa._on_device(x.device):
        kernel[(rows,)](
            x2,
            weight,
            res2 if res2 is not None else x2,
            out2,
            x2.stride(0),
            res2.stride(0) if res2 is not None else 0,
            out2.stride(0),
            float(eps),
            H=hidden,
            BLOCK=block,
            INV_H=1.0 / hidden,
            HAS_RESIDUAL=res2 is not None,
            EXACT_MUL=not interpret,
            ROUND_BF16=interpret and x.dtype == torch.bfloat16,
            PDL=pdl,
            num_warps=num_warps,
            **_pdl.launch_options(pdl),
        )
    return out


def _import_triton() -> None:
    global triton, tl, round_bf16, normed_row
    _rope._import_triton()
    triton, tl, round_bf16 = _pa.triton, _pa.tl, _rope.round_bf16
    if normed_row is None:
        normed_row = _pa._kernel(_normed_row, _pa._interpreter_mode())


def num_warps_for(block: int) -> int:
    """Warps per row program for a row of `block` (a power of two) elements. The fp32 sum's
    reduction tree follows it: every kernel normalising rows must use the same."""
    return 16 if block >= 8192 else 8 if block >= 2048 else 4 if block >= 512 else 1


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """t as a [rows, H] view, or None when that needs a copy."""
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


# ----------------------------------------------------------------------------------------------
# Kernel (a plain function; see paged_attention._kernel). Annotations are strings (future
# import), which triton reads as constexpr markers, so defining it needs no triton.


def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    res_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two of H
    INV_H: tl.constexpr,  # fp32(1 / H): torch's CUDA mean multiplies by it
    HAS_RESIDUAL: tl.constexpr,
    EXACT_MUL: tl.constexpr,  # mul.rn (no FMA contraction); False in the interpreter
    ROUND_BF16: tl.constexpr,  # round to bf16 by hand (interpreter: its fp32->bf16 truncates)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    if PDL:  # wait for the previous kernel, then release the next (kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    o = normed_row(x, w, eps, INV_H, EXACT_MUL, ROUND_BF16)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        o = r.to(tl.float32) + o
        if ROUND_BF16:
            o = round_bf16(o)
    # exact for the interpreter's truncating cast once rounded (ROUND_BF16)
    o = o.to(x.dtype)
    tl.store(out_ptr + row * stride_o + cols, o, mask=mask)


def _normed_row(
    x,
    w,
    eps,
    INV_H: tl.constexpr,
    EXACT_MUL: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """`weight * norm(x)` of one row x [BLOCK] (x's dtype, zero past H) with w [BLOCK] fp32:
    the fp32 value of the x.dtype result (each rounding step of torch's, see the module
    docstring). Shared by every kernel that normalises a row, so they agree bit for bit."""
    x32 = x.to(tl.float32)
    if EXACT_MUL:  # torch rounds the squares before summing them: no FMA into the sum
        sq = tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [x32, x32], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        sq = x32 * x32
    total = tl.sum(sq, axis=0)
    if EXACT_MUL:  # round the mean before adding eps (no FMA)
        mean = tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;",
            "=r,r,r",
            [total, INV_H],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    else:
        mean = total * INV_H
    y = x32 * tl.math.rsqrt(mean + eps)
    if ROUND_BF16:  # noqa: SIM108  (constexpr branches: only one is compiled)
        y = round_bf16(y)
    else:
        y = y.to(x.dtype).to(tl.float32)
    if EXACT_MUL:
        o = tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [w, y], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        o = w * y
    if ROUND_BF16:  # noqa: SIM108
        o = round_bf16(o)
    else:
        o = o.to(x.dtype).to(tl.float32)
    return o
