"""Decode attention of one sequence folded into the o_proj: `attend_project(...)` -> SplitSums.

Why: at one decode sequence over a short context the o_proj waits on a chain of dependent
latencies. Attention's launch waits for the qkv GEMM, reads q, walks its key tiles in splits,
merges them through an atomic ticket, stores its rows; then the o_proj's launch waits again and
loads those rows before its first MMA. On the H200 that is 7-9 us of a ~37 us Ouro layer at
c=1, while 8 MB of weight is all the o_proj reads.

Here one launch does both. A program owns heads [h0, h0 + HEADS) (that K range of the o_proj)
and BLOCK_N of its output features:
- before its PDL wait it loads its weight tile (model parameters, which no kernel writes) and
  the sequence's settled keys: the block table, seq_lens and every key but the row's own. The
  caller vouches that the kernel just before writes only the row's q and new K/V (the qkv GEMM
  with its RoPE epilogue, or RoPE + the K/V write), so they are final (kernels/pdl.py);
- after it, it reads q and the row's own key, attends for its heads in fp32 registers, rounds
  the output to the activation dtype as the attention launch stores it, and multiplies it by
  its weight tile: the o_proj's fp32 partial product over its heads.
The partials go out unsummed (kernels/split_sums): the add + norm launch after sums them in
head order, as it sums a split-K GEMM's.

Every program of a K range attends for its heads again (N / BLOCK_N times, the K/V from L2
after the first): cheap for one sequence over a short context, which is the only place the
caller takes it (`FOLD`). The values are attention's then the o_proj's up to fp32 summation
order (the attention output itself rounds as the launch's would, up to that order).
"""

from __future__ import annotations

import torch

from rlt_engine.kernels import paged_attention as _pa
from rlt_engine.kernels import pdl as _pdl
from rlt_engine.kernels.split_sums import SplitSums

__all__ = ["FOLD", "attend_project", "config"]

# Whether decode of one sequence over a short context (below paged_attention.LONG_CONTEXT
# keys) folds attention into the o_proj (the backend's switch; A/B runs set it False)
FOLD = True
# Heads and output features a program owns, its warps, keys a tile (bf16 d=128; fewer for
# wider rows): Ouro-1.4B's o_proj (2048 x 2048, 16 heads) runs 16 x 8 = 128 programs, one an
# SM, each with 64 KB of weight and a 96-key context's K/V in registers (248 of them a
# thread, no spill, per ptxas for sm_90a)
HEADS = 1
BLOCK_N = 256
NUM_WARPS = 8
BLOCK_KEYS = 128

# set by _import_triton(); the kernel's body reads them
triton = tl = round_bf16 = kv_tile3 = attend_tile3 = None


def config(n: int, num_heads: int) -> tuple[int, int]:
    """(heads, block_n) a program of an o_proj with `n` outputs over `num_heads` heads owns."""
    heads = HEADS if num_heads % HEADS == 0 else 1
    return heads, min(BLOCK_N, max(16, 1 << (n - 1).bit_length()))


def attend_project(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    w_o: torch.Tensor,
    *,
    settled: bool,
    heads: int | None = None,
    block_n: int | None = None,
    block_keys: int | None = None,
    num_warps: int | None = None,
) -> SplitSums:
    """The o_proj of one decode row's attention, as split partials over its heads:
    `SplitSums.total()` is `F.linear(attn, w_o)` with attn = paged attention of q over the
    sequence's keys [0, seq_lens[0]) rounded to q's dtype, up to fp32 summation order.

    q [1, num_heads, d] (after RoPE); k_cache / v_cache [slots, kv_heads, d], already holding
    the row's own K/V at position seq_lens[0] - 1; block_tables int32 [1, width]; seq_lens
    int32 [1]; w_o [N, num_heads * d] in q's dtype. `settled`: the caller's word that the
    kernel launched just before writes nothing this one reads but q and the row's own K/V
    (no metadata, no older key): under PDL the weight tile and the settled keys are then read
    before the wait; otherwise only the weight tile.
    `heads`, `block_n`, `block_keys`, `num_warps`: tuning overrides (tests, benchmarks)."""
    if q.dim() != 3 or q.shape[0] != 1:
        raise ValueError(f"q must be one decode row [1, heads, d], got {tuple(q.shape)}")
    _, num_heads, head_dim = q.shape
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape or k_cache.shape[2] != head_dim:
        raise ValueError(
            f"k_cache and v_cache must be [slots, kv_heads, {head_dim}], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    kv_heads = k_cache.shape[1]
    if num_heads % kv_heads:
        raise ValueError(f"{num_heads} heads do not group over {kv_heads} kv heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != 1 or seq_lens.shape != (1,):
        raise ValueError("block_tables must be [1, width] and seq_lens [1]: one sequence")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if w_o.dim() != 2 or w_o.shape[1] != num_heads * head_dim or w_o.dtype != q.dtype:
        raise ValueError(
            f"w_o must be [N, {num_heads * head_dim}] {q.dtype}, got {tuple(w_o.shape)} {w_o.dtype}"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("w_o", w_o), ("q", q)):
        if t.stride(-1) != 1 or t.device != q.device:
            raise ValueError(f"{name} must be contiguous in its last dimension on {q.device}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError("k_cache and v_cache must have q's dtype")
    ok, why = _pa.supported(q.device)
    if not ok:
        raise RuntimeError(f"Triton attend_project cannot run on {q.device}: {why}")
    _import_triton()
    n = w_o.shape[0]
    default_heads, default_block_n = config(n, num_heads)
    heads = heads or default_heads
    block_n = block_n or default_block_n
    if num_heads % heads or heads & (heads - 1):
        raise ValueError(
            f"heads a program owns ({heads}) must be a power of 2 dividing {num_heads}"
        )
    block_d = max(16, triton.next_power_of_2(head_dim))
    row_bytes = block_d * q.element_size()
    block_keys = block_keys or max(16, BLOCK_KEYS * 256 // row_bytes)
    splits = num_heads // heads
    parts = torch.empty((splits, 1, n), dtype=torch.float32, device=q.device)
    interpret = _pa._interpreter_mode()
    pdl = _pdl.enabled(q.device)
    kernel = _pa._kernel(_attend_project_kernel, interpret)
    with _pa._on_device(q.device):
        kernel[(splits, triton.cdiv(n, block_n))](
            q,
            k_cache,
            v_cache,
            w_o,
            parts,
            block_tables,
            seq_lens,
            scale * _pa._LOG2E,
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            v_cache.stride(0),
            v_cache.stride(1),
            w_o.stride(0),
            block_tables.shape[1],
            n,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_SIZE=block_size,
            GROUP=num_heads // kv_heads,
            HEADS=heads,
            BLOCK_N=block_n,
            BLOCK_KEYS=block_keys,
            PDL=pdl,
            SETTLED=settled,
            ROUND_BF16=interpret and q.dtype == torch.bfloat16,
            num_warps=num_warps or (NUM_WARPS if not interpret else 4),
            **_pdl.launch_options(pdl),
        )
    return SplitSums(parts, q.dtype)


def _import_triton() -> None:
    global triton, tl, round_bf16, kv_tile3, attend_tile3
    from rlt_engine.kernels import rope as _rope

    _rope._import_triton()
    triton, tl, round_bf16 = _pa.triton, _pa.tl, _rope.round_bf16
    interpret = _pa._interpreter_mode()
    kv_tile3 = _pa._kernel(_kv_tile3, interpret)
    attend_tile3 = _pa._kernel(_attend_tile3, interpret)


# ----------------------------------------------------------------------------------------------
# Kernel (a plain function; see paged_attention._kernel). Annotations are strings (future
# import), which triton reads as constexpr markers, so defining it needs no triton.


def _attend_project_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    w_ptr,
    parts_ptr,  # fp32 [splits, 1, N]
    block_tables_ptr,
    seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_wn,
    max_blocks,
    N,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    HEADS: tl.constexpr,  # query heads a program owns: its K range of the o_proj
    BLOCK_N: tl.constexpr,  # output features a program owns
    BLOCK_KEYS: tl.constexpr,
    PDL: tl.constexpr,
    SETTLED: tl.constexpr,  # the caller's word: the kernel before writes only q and own K/V
    ROUND_BF16: tl.constexpr,  # the interpreter's fp32 -> bf16 cast truncates: round by hand
):
    split = tl.program_id(0)
    head = split * HEADS + tl.arange(0, HEADS)  # [HEADS]
    kv_off = (head // GROUP).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    # Before any wait: the weight tile [BLOCK_N, HEADS, BLOCK_D] (columns head * HEAD_DIM + d)
    w = tl.load(
        w_ptr + n.to(tl.int64)[:, None, None] * stride_wn
        + (head * HEAD_DIM)[None, :, None] + d[None, None, :],
        mask=n_ok[:, None, None] & d_ok[None, None, :],
        other=0.0,
    )  # fmt: skip
    if PDL and not SETTLED:  # wait for the kernel before, then release the next
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # The first key tile's table entries and its settled keys (every key but the row's own):
    # SETTLED, before the wait (the caller's word that the kernel before writes none of them)
    table, k_base, v_base = block_tables_ptr, k_ptr, v_ptr
    seq_len = tl.load(seq_lens_ptr)
    pos = tl.arange(0, BLOCK_KEYS)
    blk = pos // BLOCK_SIZE
    phys = tl.load(table + blk, mask=(pos < seq_len) & (blk < max_blocks), other=0)
    slot = phys.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    k, v = kv_tile3(k_base, v_base, slot, pos < seq_len - 1, kv_off, d, d_ok,
                    stride_ks, stride_kh, stride_vs, stride_vh, 0.0, 0.0)  # fmt: skip
    if PDL and SETTLED:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # the row's own key and q, written by the kernel before
    k, v = kv_tile3(k_base, v_base, slot, pos == seq_len - 1, kv_off, d, d_ok,
                    stride_ks, stride_kh, stride_vs, stride_vh, k, v)  # fmt: skip
    q = tl.load(q_ptr + head[:, None] * stride_qh + d[None, :], mask=d_ok[None, :], other=0.0)
    q = q.to(tl.float32) * qk_scale  # [HEADS, BLOCK_D]

    m_i = tl.full([HEADS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HEADS], dtype=tl.float32)
    acc = tl.zeros([HEADS, BLOCK_D], dtype=tl.float32)
    m_i, l_i, acc = attend_tile3(q, k, v, pos < seq_len, m_i, l_i, acc)
    for t in range(1, tl.cdiv(seq_len, BLOCK_KEYS)):  # longer contexts: the other tiles
        pos = t * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS)
        pos_ok = pos < seq_len
        blk = pos // BLOCK_SIZE
        phys = tl.load(table + blk, mask=pos_ok & (blk < max_blocks), other=0)
        slot = phys.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        k, v = kv_tile3(k_base, v_base, slot, pos_ok, kv_off, d, d_ok,
                        stride_ks, stride_kh, stride_vs, stride_vh, 0.0, 0.0)  # fmt: skip
        m_i, l_i, acc = attend_tile3(q, k, v, pos_ok, m_i, l_i, acc)

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # no key (an idle row): zeros
    # the attention output as the launch stores it, in the activation dtype (a constexpr branch)
    if ROUND_BF16:  # noqa: SIM108
        o = round_bf16(o)
    else:
        o = o.to(q_ptr.dtype.element_ty).to(tl.float32)
    part = tl.sum(tl.sum(w.to(tl.float32) * o[None, :, :], axis=2), axis=1)  # [BLOCK_N]
    tl.store(parts_ptr + split.to(tl.int64) * N + n, part, mask=n_ok)


def _kv_tile3(k_base, v_base, slot, ok, kv_off, d, d_ok, stride_ks, stride_kh, stride_vs,
              stride_vh, k_else, v_else):  # fmt: skip
    """K and V [BLOCK_KEYS, HEADS, BLOCK_D] of the program's heads at cache slots `slot`,
    read where `ok` (else k_else / v_else: 0, or the values read before)."""
    mask = ok[:, None, None] & d_ok[None, None, :]
    k = tl.load(
        k_base + slot[:, None, None] * stride_ks + kv_off[None, :, None] * stride_kh
        + d[None, None, :],
        mask=mask,
        other=k_else,
    )  # fmt: skip
    v = tl.load(
        v_base + slot[:, None, None] * stride_vs + kv_off[None, :, None] * stride_vh
        + d[None, None, :],
        mask=mask,
        other=v_else,
    )  # fmt: skip
    return k, v


def _attend_tile3(q, k, v, pos_ok, m_i, l_i, acc):
    """One key tile of the online softmax for each of the program's heads: q [HEADS, BLOCK_D]
    (scaled, base 2), k / v [BLOCK_KEYS, HEADS, BLOCK_D]; fp32 throughout, as the rows
    kernel of paged_attention."""
    s = tl.sum(k.to(tl.float32) * q[None, :, :], axis=2)  # [BLOCK_KEYS, HEADS]
    s = tl.where(pos_ok[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: no NaN
    p = tl.exp2(s - m_ref[None, :])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32), axis=0)
    return m_new, l_i, acc
