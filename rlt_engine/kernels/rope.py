"""Rotary position embedding applied in place to q and k in one Triton launch.

`apply_rope_(q, k, cos, sin)` reproduces `layers.apply_rope` rounding step by rounding step:

    out = x * cos + rotate_half(x) * sin          rotate_half(x) = cat(-x[D/2:], x[:D/2])

torch computes x*cos (rounded to x.dtype), rotated*sin (rounded), then their sum (rounded); the
kernel computes each product in fp32, rounds it to x.dtype, adds in fp32 and rounds, so bf16 /
fp16 / fp32 results equal torch's bit for bit (the product of two bf16 or fp16 values is exact in
fp32, and torch's eager ops do the same fp32 operations). On the GPU the products use `mul.rn`,
so the compiler cannot contract them with the add into an FMA (which would change fp32 results).

A program owns one row and a tile of BLOCK_H heads of the concatenated (q heads, k heads), so q
and k may be any views with a contiguous last dimension (e.g. slices of a packed qkv projection
output). CUDA-graph capturable: no host synchronisation, the grid depends only on the shapes.

triton is imported lazily (see paged_attention: the interpreter mode and its workarounds).
"""

from __future__ import annotations

import torch

from rlt_engine.kernels import paged_attention as _pa
from rlt_engine.kernels.paged_attention import supported

__all__ = ["apply_rope_", "apply_rope_reference", "supported"]

triton = tl = None  # set by _import_triton(); the kernel's body reads the module global `tl`

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch semantics (layers.apply_rope): x [rows, heads, D]; cos/sin [rows, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [rows, heads, D] and k [rows, kv_heads, D] in place by cos/sin [rows, D] (in
    q's dtype). q and k need a contiguous last dimension (any other strides); D must be even."""
    _launch(q, k, cos, sin)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    block_h: int | None = None,
    num_warps: int = 4,
) -> None:
    """`apply_rope_` with tuning overrides (tests: several head tiles; benchmarks)."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"expected q [rows, heads, D] and k [rows, kv_heads, D], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}"
        )
    rows, num_heads, head_dim = q.shape
    if k.shape[0] != rows or k.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on rows or D")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype:
        raise ValueError(f"q and k must share one of {_DTYPES}, got {q.dtype}, {k.dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (rows, head_dim) or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name} must be [{rows}, {head_dim}] {q.dtype} on {q.device}, got "
                f"{tuple(t.shape)} {t.dtype} on {t.device}"
            )
    if k.device != q.device:
        raise ValueError(f"k is on {k.device}, q on {q.device}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k must be contiguous in their last dimension (updated in place)")
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    num_kv_heads = k.shape[1]
    total = num_heads + num_kv_heads
    if rows == 0 or total == 0 or head_dim == 0:
        return
    ok, why = supported(q.device)
    if not ok:
        raise RuntimeError(f"Triton apply_rope_ cannot run on {q.device}: {why}")
    _import_triton()
    interpret = _pa._interpreter_mode()

    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    if block_h is None:  # ~1024 elements per half tile: Ouro 16 + 16 heads x 128 -> 2 programs
        block_h = max(1, min(triton.next_power_of_2(total), 1024 // block_half))
    kernel = _pa._kernel(_rope_kernel, interpret)
    with _pa._on_device(q.device):
        kernel[(rows, triton.cdiv(total, block_h))](
            q,
            k,
            cos,
            sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            sin.stride(0),
            num_heads,
            total,
            HALF=half,
            BLOCK_HALF=block_half,
            BLOCK_H=block_h,
            EXACT_MUL=not interpret,
            ROUND_BF16=interpret and q.dtype == torch.bfloat16,
            num_warps=num_warps,
        )


def _import_triton() -> None:
    global triton, tl, round_bf16, rope_products, rope_round, rotate_halves, rotate_full
    _pa._import_triton()
    triton, tl = _pa.triton, _pa.tl
    if round_bf16 is None:
        interpret = _pa._interpreter_mode()
        round_bf16 = _pa._kernel(_round_bf16, interpret)
        rope_products = _pa._kernel(_rope_products, interpret)
        rope_round = _pa._kernel(_rope_round, interpret)
        rotate_halves = _pa._kernel(_rotate_halves, interpret)
        rotate_full = _pa._kernel(_rotate_full, interpret)


# the @jit forms of the helpers below, set by _import_triton()
round_bf16 = rope_products = rope_round = rotate_halves = rotate_full = None


def _round_bf16(v):
    """fp32 -> nearest bf16 (ties to even), kept in fp32. For the Triton *interpreter*, whose
    fp32 -> bf16 cast truncates; kernels call it under a constexpr flag that is False when
    compiled (a @jit function all the same: triton hashes every function a kernel names).
    NaNs are not preserved (never produced from finite inputs here)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


# ----------------------------------------------------------------------------------------------
# Kernel (a plain function; see paged_attention._kernel). Annotations are strings (future
# import), which triton reads as constexpr markers, so defining it needs no triton.


def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qr,
    stride_qh,
    stride_kr,
    stride_kh,
    stride_cos,
    stride_sin,
    num_heads,  # q heads; heads [num_heads, total) are k's
    total,  # num_heads + num_kv_heads
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_HALF: tl.constexpr,  # next power of two of HALF
    BLOCK_H: tl.constexpr,  # heads per program
    EXACT_MUL: tl.constexpr,  # mul.rn (no FMA contraction); False in the interpreter
    ROUND_BF16: tl.constexpr,  # round to bf16 by hand (interpreter: its fp32->bf16 truncates)
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_ok = d < HALF
    c1 = tl.load(cos_ptr + row * stride_cos + d, mask=d_ok, other=0.0)
    c2 = tl.load(cos_ptr + row * stride_cos + HALF + d, mask=d_ok, other=0.0)
    s1 = tl.load(sin_ptr + row * stride_sin + d, mask=d_ok, other=0.0)
    s2 = tl.load(sin_ptr + row * stride_sin + HALF + d, mask=d_ok, other=0.0)
    c1, c2 = c1.to(tl.float32), c2.to(tl.float32)
    s1, s2 = s1.to(tl.float32), s2.to(tl.float32)

    is_q = (head < num_heads) & d_ok
    is_k = (head >= num_heads) & (head < total) & d_ok
    q_off = row * stride_qr + head.to(tl.int64) * stride_qh + d
    k_off = row * stride_kr + (head - num_heads).to(tl.int64) * stride_kh + d
    x1q = tl.load(q_ptr + q_off, mask=is_q, other=0.0)
    x2q = tl.load(q_ptr + q_off + HALF, mask=is_q, other=0.0)
    x1k = tl.load(k_ptr + k_off, mask=is_k, other=0.0)
    x2k = tl.load(k_ptr + k_off + HALF, mask=is_k, other=0.0)
    x1 = tl.where(is_q, x1q, x1k)
    x2 = tl.where(is_q, x2q, x2k)
    o1, o2 = rotate_halves(x1, x2, c1, c2, s1, s2, EXACT_MUL, ROUND_BF16)
    tl.store(q_ptr + q_off, o1, mask=is_q)
    tl.store(q_ptr + q_off + HALF, o2, mask=is_q)
    tl.store(k_ptr + k_off, o1, mask=is_k)
    tl.store(k_ptr + k_off + HALF, o2, mask=is_k)


def _rotate_halves(x1, x2, c1, c2, s1, s2, EXACT_MUL: tl.constexpr, ROUND_BF16: tl.constexpr):
    """RoPE of a head's halves x1 = x[:D/2], x2 = x[D/2:] (x's dtype) by the fp32 cos / sin
    halves: (x1*c1 - x2*s1, x2*c2 + x1*s2) in x's dtype, each product rounded to the dtype as
    torch rounds it (see the module docstring). Shared by the kernels that rotate heads."""
    dtype = x1.dtype
    a1, b1 = rope_products(x1, x2, c1, s1, EXACT_MUL, ROUND_BF16)
    a2, b2 = rope_products(x2, x1, c2, s2, EXACT_MUL, ROUND_BF16)
    # a - b == a + (-b) exactly: the negation of rotate_half costs no rounding
    return rope_round(a1 - b1, dtype, ROUND_BF16), rope_round(a2 + b2, dtype, ROUND_BF16)


def _rotate_full(x, partner, c, s, first, EXACT_MUL: tl.constexpr, ROUND_BF16: tl.constexpr):
    """RoPE of whole heads x (x's dtype) given `partner`, x with its halves swapped (element
    d holds x[d + D/2] where `first`, the first half, else x[d - D/2]), by the fp32 cos / sin
    c, s: x*c - partner*s on the first half, x*c + partner*s on the second, each product
    rounded to the dtype: the values of `_rotate_halves`, for kernels that hold a head whole."""
    a, b = rope_products(x, partner, c, s, EXACT_MUL, ROUND_BF16)
    return rope_round(tl.where(first, a - b, a + b), x.dtype, ROUND_BF16)


def _rope_products(x, y, c, s, EXACT_MUL: tl.constexpr, ROUND_BF16: tl.constexpr):
    """(x*c, y*s) in fp32, each rounded to x's dtype and kept in fp32 (products by mul.rn, so
    the compiler cannot contract them with the sum after into an FMA)."""
    dtype = x.dtype
    x, y = x.to(tl.float32), y.to(tl.float32)
    if EXACT_MUL:
        a = tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, c], dtype=tl.float32, is_pure=True, pack=1
        )
        b = tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [y, s], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        a, b = x * c, y * s
    if ROUND_BF16:
        return round_bf16(a), round_bf16(b)
    return a.to(dtype).to(tl.float32), b.to(dtype).to(tl.float32)


def _rope_round(v, dtype: tl.constexpr, ROUND_BF16: tl.constexpr):
    """The fp32 sum of two rounded products, rounded to `dtype`."""
    if ROUND_BF16:
        return round_bf16(v).to(dtype)
    return v.to(dtype)
