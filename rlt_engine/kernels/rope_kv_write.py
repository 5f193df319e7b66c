"""RoPE on q and k and the K/V write into the paged pool in one Triton launch.

`rope_write_kv_(q, k, v, cos, sin, k_pool, v_pool, slot_mapping)` does what
`rope.apply_rope_(q, k, cos, sin)` followed by `kv_write.write_kv_(k_pool, v_pool, k, v,
slot_mapping)` does, in one launch instead of two: q and k are rotated in place and the rotated
k and v land in k_pool / v_pool at row slot_mapping[r]. The rotation is rope.py's own head code
(`_rotate_halves`), so q, k and both pools end bit-identical to the two launches in every dtype.

A program owns one row and a tile of BLOCK_H heads of the concatenated (q heads, k heads, v
heads); q, k and v may be any views with a contiguous last dimension (slices of the packed qkv
projection output). Rows mapped to the trash slot race only among themselves (never read).
CUDA-graph capturable: no host synchronisation, the grid depends only on the shapes. triton is
imported lazily (see paged_attention).
"""

from __future__ import annotations

import torch

from rlt_engine.kernels import paged_attention as _pa
from rlt_engine.kernels import pdl as _pdl
from rlt_engine.kernels import rope as _rope
from rlt_engine.kernels.paged_attention import supported

__all__ = ["rope_write_kv_", "supported"]

triton = tl = rotate_halves = None  # set by _import_triton(); read by the kernel's body

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rope_write_kv_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """q [rows, heads, D], k / v [rows, kv_heads, D] (contiguous last dimension, any other
    strides), cos / sin [rows, D] in q's dtype, k_pool / v_pool [slots, kv_heads, D] contiguous
    in q's dtype, slot_mapping [rows] integer. Rotates q and k in place; writes the rotated k
    and v to the pools' rows slot_mapping."""
    _launch(q, k, v, cos, sin, k_pool, v_pool, slot_mapping)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    block_h: int | None = None,
    num_warps: int = 4,
) -> None:
    """`rope_write_kv_` with tuning overrides (tests: several head tiles)."""
    _check(q, k, v, cos, sin, k_pool, v_pool, slot_mapping)
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    total = num_heads + 2 * num_kv_heads
    if rows == 0 or head_dim == 0:
        return
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    ok, why = supported(q.device)
    if not ok:
        raise RuntimeError(f"Triton rope_write_kv_ cannot run on {q.device}: {why}")
    _import_triton()
    interpret = _pa._interpreter_mode()
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    if block_h is None:  # ~1024 elements per half tile: Ouro 16 + 16 + 16 heads -> 3 programs
        block_h = max(1, min(triton.next_power_of_2(total), 1024 // block_half))
    kernel = _pa._kernel(_rope_kv_write_kernel, interpret)
    pdl = _pdl.enabled(q.device)
    with _pa._on_device(q.device):
        kernel[(rows, triton.cdiv(total, block_h))](
            q,
            k,
            v,
            cos,
            sin,
            k_pool,
            v_pool,
            slot_mapping.to(torch.int64).contiguous(),  # read as row i at offset i
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            cos.stride(0),
            sin.stride(0),
            num_heads,
            num_kv_heads,
            HALF=half,
            BLOCK_HALF=block_half,
            BLOCK_H=block_h,
            EXACT_MUL=not interpret,
            ROUND_BF16=interpret and q.dtype == torch.bfloat16,
            PDL=pdl,
            num_warps=num_warps,
            **_pdl.launch_options(pdl),
        )


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"expected q [rows, heads, D] and k, v [rows, kv_heads, D], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    rows, _, head_dim = q.shape
    if k.shape[0] != rows or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree, or D is odd")
    if q.dtype not in _DTYPES or any(t.dtype != q.dtype for t in (k, v, k_pool, v_pool)):
        raise ValueError(f"q, k, v and the pools must share one of {_DTYPES}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (rows, head_dim) or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name} must be [{rows}, {head_dim}] {q.dtype} on {q.device}, got "
                f"{tuple(t.shape)} {t.dtype} on {t.device}"
            )
    if k_pool.shape != v_pool.shape or k_pool.dim() != 3 or k_pool.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"k_pool and v_pool must be [slots, {k.shape[1]}, {head_dim}], got "
            f"{tuple(k_pool.shape)}, {tuple(v_pool.shape)}"
        )
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("k_pool and v_pool must be contiguous")
    if slot_mapping.shape != (rows,) or slot_mapping.dtype.is_floating_point:
        raise ValueError(f"slot_mapping must be [{rows}] integer, got {tuple(slot_mapping.shape)}")
    if any(t.device != q.device for t in (k, v, k_pool, v_pool, slot_mapping)):
        raise ValueError(f"every tensor must be on {q.device}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v must be contiguous in their last dimension")


def _import_triton() -> None:
    global triton, tl, rotate_halves
    _rope._import_triton()
    triton, tl, rotate_halves = _rope.triton, _rope.tl, _rope.rotate_halves


# ----------------------------------------------------------------------------------------------
# Kernel (a plain function; see paged_attention._kernel). Annotations are strings (future
# import), which triton reads as constexpr markers, so defining it needs no triton.


def _rope_kv_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    k_pool_ptr,
    v_pool_ptr,
    slot_ptr,
    stride_qr,
    stride_qh,
    stride_kr,
    stride_kh,
    stride_vr,
    stride_vh,
    stride_cos,
    stride_sin,
    num_heads,  # q heads; then num_kv_heads k heads, then num_kv_heads v heads
    num_kv_heads,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_HALF: tl.constexpr,  # next power of two of HALF
    BLOCK_H: tl.constexpr,  # heads per program
    EXACT_MUL: tl.constexpr,  # mul.rn (no FMA contraction); False in the interpreter
    ROUND_BF16: tl.constexpr,  # round to bf16 by hand (interpreter: its fp32->bf16 truncates)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    if PDL:  # wait for the previous kernel, then release the next (kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_ok = d < HALF
    c1 = tl.load(cos_ptr + row * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row * stride_cos + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row * stride_sin + d, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row * stride_sin + HALF + d, mask=d_ok, other=0.0).to(tl.float32)

    k_end = num_heads + num_kv_heads
    is_q = (head < num_heads) & d_ok
    is_k = (head >= num_heads) & (head < k_end) & d_ok
    is_v = (head >= k_end) & (head < k_end + num_kv_heads) & d_ok
    q_off = row * stride_qr + head.to(tl.int64) * stride_qh + d
    k_off = row * stride_kr + (head - num_heads).to(tl.int64) * stride_kh + d
    v_off = row * stride_vr + (head - k_end).to(tl.int64) * stride_vh + d
    x1q = tl.load(q_ptr + q_off, mask=is_q, other=0.0)
    x2q = tl.load(q_ptr + q_off + HALF, mask=is_q, other=0.0)
    x1k = tl.load(k_ptr + k_off, mask=is_k, other=0.0)
    x2k = tl.load(k_ptr + k_off + HALF, mask=is_k, other=0.0)
    x1v = tl.load(v_ptr + v_off, mask=is_v, other=0.0)
    x2v = tl.load(v_ptr + v_off + HALF, mask=is_v, other=0.0)
    o1, o2 = rotate_halves(
        tl.where(is_q, x1q, x1k), tl.where(is_q, x2q, x2k), c1, c2, s1, s2, EXACT_MUL, ROUND_BF16
    )
    tl.store(q_ptr + q_off, o1, mask=is_q)
    tl.store(q_ptr + q_off + HALF, o2, mask=is_q)
    tl.store(k_ptr + k_off, o1, mask=is_k)
    tl.store(k_ptr + k_off + HALF, o2, mask=is_k)

    slot = tl.load(slot_ptr + row)  # int64: the pool exceeds 2**31 elements
    kv_head = tl.where(head < k_end, head - num_heads, head - k_end).to(tl.int64)
    pool_off = slot * (num_kv_heads * 2 * HALF) + kv_head * (2 * HALF) + d
    tl.store(k_pool_ptr + pool_off, o1, mask=is_k)
    tl.store(k_pool_ptr + pool_off + HALF, o2, mask=is_k)
    tl.store(v_pool_ptr + pool_off, x1v, mask=is_v)
    tl.store(v_pool_ptr + pool_off + HALF, x2v, mask=is_v)
