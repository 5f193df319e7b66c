"""The packed q/k/v projection, RoPE and the K/V write of decode rows in one Triton launch.

`qkv_rope_write(x, w, cos, sin, k_pool, v_pool, slot_mapping, num_heads, num_kv_heads, config)`
returns qkv = x @ w.T [M, (heads + 2 kv_heads) * D] with q and k rotated, and writes the rotated
k and the v of row m to k_pool / v_pool at row slot_mapping[m]: what the small GEMM
(kernels/small_gemm) followed by `rope_kv_write.rope_write_kv_` leave behind, in one launch.

A program owns one head and BLOCK_J of its D / 2 rotation pairs: it streams the weight rows
j0.. of the head's first half and the matching rows of its second half with two swap-AB dots per
K step (the small GEMM's layout, as kernels/gate_up_swiglu pairs gate and up rows), so both
halves of every pair it rotates are in its registers. Each accumulator is rounded to the dtype
as the GEMM would store it, then rotated by rope's own code (`rotate_halves`): under the
interpreter the result is bit-identical to the two launches; on the GPU to the two launches
with a BLOCK_J-row GEMM tile (the same dots), tested.

For decode (M <= small_gemm.MAX_M) where the small-GEMM table has a Triton config for the
packed shape; elsewhere `qkv_rope_write` returns None and the caller runs the two launches.
CUDA-graph capturable; triton imported lazily.
"""

from __future__ import annotations

import torch

from rlt_engine.kernels import paged_attention as _pa
from rlt_engine.kernels import pdl as _pdl
from rlt_engine.kernels import rope as _rope
from rlt_engine.kernels import small_gemm as _gemm

__all__ = ["qkv_rope_write"]

# set by _import_triton(); read by the kernel
triton = tl = round_bf16 = rotate_halves = prefetch_l2 = None


def qkv_rope_write(
    x: torch.Tensor,
    w: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    config: _gemm.GemmConfig | None = None,
) -> torch.Tensor | None:
    """x [M, K]; w [(heads + 2 kv_heads) * D, K] packed (q; k; v) and contiguous; cos / sin
    [M, D] in x's dtype; k_pool / v_pool [slots, kv_heads, D] contiguous; slot_mapping [M].
    Returns qkv [M, (heads + 2 kv_heads) * D] (q and k rotated) and writes the pools, or None
    where the table has no Triton config (the caller runs the GEMM and rope_write_kv_).
    `config` (tests, benchmarks) forces one: its block_n / 2 is BLOCK_J."""
    if config is None:
        config = _gemm.choose(x, w, gated=True)
        if config is None or config.split_k != 1:
            return None
    total = num_heads + 2 * num_kv_heads
    if w.dim() != 2 or w.shape[0] % total or x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"need x [M, K] and w [heads * D, K], got {x.shape}, {w.shape}")
    m, k = x.shape
    head_dim = w.shape[0] // total
    if m > _gemm.MAX_M or head_dim % 2 or config.block_n % 32 or not w.is_contiguous():
        raise ValueError(f"at most {_gemm.MAX_M} rows, even D, block_n % 32 == 0, w contiguous")
    if any(t.dtype != x.dtype or t.device != x.device for t in (w, cos, sin, k_pool, v_pool)):
        raise ValueError("x, w, cos, sin and the pools must share a dtype and a device")
    if cos.shape != (m, head_dim) or sin.shape != (m, head_dim) or slot_mapping.shape != (m,):
        raise ValueError(f"cos / sin must be [{m}, {head_dim}] and slot_mapping [{m}]")
    pool_shape = (num_kv_heads, head_dim)
    if k_pool.shape[1:] != pool_shape or v_pool.shape != k_pool.shape:
        raise ValueError(f"the pools must be [slots, {num_kv_heads}, {head_dim}]")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("k_pool and v_pool must be contiguous")
    qkv = torch.empty((m, total * head_dim), dtype=x.dtype, device=x.device)
    if m == 0:
        return qkv
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    interpret = _gemm._ready(x.device)
    _import_triton()
    half = head_dim // 2
    block_j = config.block_n // 2
    pdl = _pdl.enabled(x.device)
    prefetch_k = _pdl.prefetch_k(2 * total * half, 1, k, config.block_k, x.element_size())
    kernel = _pa._kernel(_qkv_rope_kernel, interpret)
    with _pa._on_device(x.device):
        kernel[(total, triton.cdiv(half, block_j))](
            x,
            w,
            qkv,
            cos,
            sin,
            k_pool,
            v_pool,
            slot_mapping.to(torch.int64),
            m,
            k,
            x.stride(0),
            cos.stride(0),
            sin.stride(0),
            prefetch_k if pdl else 0,
            NUM_HEADS=num_heads,
            NUM_KV=num_kv_heads,
            HALF=half,
            BLOCK_M=max(16, triton.next_power_of_2(m)),
            BLOCK_J=block_j,
            BLOCK_K=config.block_k,
            EVEN=half % block_j == 0 and k % config.block_k == 0,
            EXACT_MUL=not interpret,
            UPCAST=interpret and x.dtype != torch.float32,
            ROUND_BF16=interpret and x.dtype == torch.bfloat16,
            PDL=pdl,
            LINE=_pdl.LINE_BYTES // x.element_size(),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **_pdl.launch_options(pdl),
        )
    return qkv


def _import_triton() -> None:
    global triton, tl, round_bf16, rotate_halves, prefetch_l2
    _rope._import_triton()
    _pdl._import_triton()
    triton, tl, round_bf16, rotate_halves = (
        _pa.triton,
        _pa.tl,
        _rope.round_bf16,
        _rope.rotate_halves,
    )
    prefetch_l2 = _pdl.prefetch_l2


def _qkv_rope_kernel(
    x_ptr,
    w_ptr,
    qkv_ptr,  # out [M, (NUM_HEADS + 2 NUM_KV) * 2 HALF] contiguous
    cos_ptr,
    sin_ptr,
    k_pool_ptr,
    v_pool_ptr,
    slot_ptr,  # int64 [M]
    M,
    K,
    stride_xm,
    stride_cos,
    stride_sin,
    prefetch_k,  # PDL: columns of its weight rows each program prefetches before the wait
    NUM_HEADS: tl.constexpr,  # q heads, then NUM_KV k heads, then NUM_KV v heads
    NUM_KV: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_M: tl.constexpr,
    BLOCK_J: tl.constexpr,  # rotation pairs per program
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # HALF % BLOCK_J == 0 and K % BLOCK_K == 0: no masks on the weights
    EXACT_MUL: tl.constexpr,  # rope's mul.rn products (False in the interpreter)
    UPCAST: tl.constexpr,  # interpreter: its bf16 dot is wrong; fp32 products are exact
    ROUND_BF16: tl.constexpr,  # interpreter: its fp32->bf16 conversion truncates
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
    LINE: tl.constexpr,  # elements per 128-byte line (PDL's prefetch)
):
    head = tl.program_id(0)
    j0 = tl.program_id(1) * BLOCK_J
    rows = tl.arange(0, BLOCK_J)
    cols = tl.arange(0, BLOCK_M)
    j_ok = (j0 + rows) < HALF
    m_ok = cols < M
    first = w_ptr + (head * 2 * HALF + j0).to(tl.int64) * K  # rows of the head's first half
    second = first + HALF * K  # the matching rows of its second half
    if PDL:  # the weights depend on no kernel: start their stream, then wait (kernels/pdl.py)
        k_end = tl.minimum(prefetch_k, K)
        prefetch_l2(first, rows, j_ok, K, 0, k_end, BLOCK_K, LINE)
        prefetch_l2(second, rows, j_ok, K, 0, k_end, BLOCK_K, LINE)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc1 = tl.zeros((BLOCK_J, BLOCK_M), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_J, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        offs = rows[:, None] * K + ks[None, :]
        x_ptrs = x_ptr + cols[None, :] * stride_xm + ks[:, None]
        if EVEN:
            xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            w1 = tl.load(first + offs)
            w2 = tl.load(second + offs)
        else:
            k_ok = ks < K
            xt = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            w_ok = j_ok[:, None] & k_ok[None, :]
            w1 = tl.load(first + offs, mask=w_ok, other=0.0)
            w2 = tl.load(second + offs, mask=w_ok, other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            acc1 = tl.dot(w1.to(tl.float32), xt, acc1, input_precision="ieee")
            acc2 = tl.dot(w2.to(tl.float32), xt, acc2, input_precision="ieee")
        else:
            acc1 = tl.dot(w1, xt, acc1, input_precision="ieee")
            acc2 = tl.dot(w2, xt, acc2, input_precision="ieee")

    dtype = qkv_ptr.dtype.element_ty
    if ROUND_BF16:  # the GEMM's stores: each projection rounded to the dtype
        y1, y2 = round_bf16(acc1).to(dtype), round_bf16(acc2).to(dtype)
    else:
        y1, y2 = acc1.to(dtype), acc2.to(dtype)
    jj = (j0 + rows)[:, None]  # [BLOCK_J, 1] pair index within the head
    mm = cols[None, :].to(tl.int64)  # [1, BLOCK_M] row
    ok = j_ok[:, None] & m_ok[None, :]
    width = (NUM_HEADS + 2 * NUM_KV) * 2 * HALF
    out = qkv_ptr + mm * width + head * 2 * HALF + jj
    is_q = head < NUM_HEADS
    is_k = (head >= NUM_HEADS) & (head < NUM_HEADS + NUM_KV)
    is_v = head >= NUM_HEADS + NUM_KV
    if is_q | is_k:  # rope_kv_write's rotation of this row's head, from the same values
        c1 = tl.load(cos_ptr + mm * stride_cos + jj, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + mm * stride_cos + HALF + jj, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + mm * stride_sin + jj, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + mm * stride_sin + HALF + jj, mask=ok, other=0.0).to(tl.float32)
        o1, o2 = rotate_halves(y1, y2, c1, c2, s1, s2, EXACT_MUL, ROUND_BF16)
    else:
        o1, o2 = y1, y2
    tl.store(out, o1, mask=ok)
    tl.store(out + HALF, o2, mask=ok)
    if not is_q:  # k and v rows also go to the pools, at the row's slot
        slot = tl.load(slot_ptr + cols, mask=m_ok, other=0)[None, :]
        kv_head = tl.where(is_k, head - NUM_HEADS, head - NUM_HEADS - NUM_KV)
        pool = slot * (NUM_KV * 2 * HALF) + kv_head * 2 * HALF + jj
        tl.store(k_pool_ptr + pool, o1, mask=ok & is_k)
        tl.store(k_pool_ptr + pool + HALF, o2, mask=ok & is_k)
        tl.store(v_pool_ptr + pool, o1, mask=ok & is_v)
        tl.store(v_pool_ptr + pool + HALF, o2, mask=ok & is_v)
