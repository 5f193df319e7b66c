"""SwiGLU's activation in one Triton launch: `silu_mul(gate_up) = silu(gate) * up`, where
gate_up [rows, 2I] is the packed gate/up projection output (gate = first I columns).

torch runs two kernels (silu, then mul) and rounds between them; this kernel does the same
roundings in one pass: silu in fp32 as torch's CUDA kernel computes it (x / (1 + exp(-x)), an
IEEE division and libdevice's expf), rounded to the dtype, times `up` in fp32 (exact for bf16 /
fp16 products), rounded. So on the GPU the result equals torch's bit for bit; under the
interpreter `exp` is numpy's (torch's CPU silu uses its own vectorised exp), so results there
agree to an ulp of the fp32 silu. CUDA-graph capturable.

triton is imported lazily (see paged_attention: the interpreter mode and its workarounds).
"""

from __future__ import annotations

import torch

from rlt_engine.kernels import paged_attention as _pa
from rlt_engine.kernels import rope as _rope
from rlt_engine.kernels.paged_attention import supported

__all__ = ["silu_mul", "silu_mul_reference", "supported"]

triton = tl = libdevice = round_bf16 = None  # set by _import_triton(); read by the kernel

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK = 1024  # columns per program


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"expected gate_up [rows, 2 * I], got {tuple(gate_up.shape)}")
    if gate_up.dtype not in _DTYPES:
        raise ValueError(f"gate_up must be one of {_DTYPES}, got {gate_up.dtype}")
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or width == 0:
        return out
    ok, why = supported(gate_up.device)
    if not ok:
        raise RuntimeError(f"Triton silu_mul cannot run on {gate_up.device}: {why}")
    _import_triton()
    interpret = _pa._interpreter_mode()
    kernel = _pa._kernel(_silu_mul_kernel, interpret)
    with _pa._on_device(gate_up.device):
        kernel[(rows, triton.cdiv(width, BLOCK))](
            gate_up,
            out,
            gate_up.stride(0),
            width,
            BLOCK=BLOCK,
            EXACT=not interpret,
            ROUND_BF16=interpret and gate_up.dtype == torch.bfloat16,
        )
    return out


def _import_triton() -> None:
    global triton, tl, libdevice, round_bf16
    triton, tl = _pa.require_triton()
    if libdevice is None:
        from triton.language.extra import libdevice as libdevice_module

        libdevice = libdevice_module
    _rope._import_triton()
    round_bf16 = _rope.round_bf16


def _silu_mul_kernel(
    in_ptr,
    out_ptr,
    stride_row,
    width,
    BLOCK: tl.constexpr,
    EXACT: tl.constexpr,  # libdevice expf + IEEE division, as torch's CUDA silu (compiled only)
    ROUND_BF16: tl.constexpr,  # round to bf16 by hand (interpreter: its fp32->bf16 truncates)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    base = in_ptr + row * stride_row
    gate = tl.load(base + cols, mask=mask, other=0.0)
    up = tl.load(base + width + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    g, u = gate.to(tl.float32), up.to(tl.float32)
    if EXACT:  # noqa: SIM108 - a constexpr branch: only the taken one is compiled
        silu = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
    else:
        silu = g / (1.0 + tl.exp(-g))
    if ROUND_BF16:
        out = round_bf16(round_bf16(silu) * u).to(dtype)
    else:
        out = (silu.to(dtype).to(tl.float32) * u).to(dtype)
    tl.store(out_ptr + row * width + cols, out, mask=mask)
