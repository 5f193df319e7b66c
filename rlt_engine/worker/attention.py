"""Attention backends over the paged, depth-aware KV cache.

The cache holds K and V as [layers, num_slots + 1, kv_heads, head_dim] (flat slots; slot =
block * block_size + offset). The extra last slot is a trash slot: rows that must not write
(idle rows of a fixed-shape decode batch) write there, so no traversal needs a data-dependent
shape. Every sequence of a call reads through ONE block table — the plane its loop selects —
so the depth dimension never reaches the kernels.

- `torch`: the reference, any device; eager only (its gather width follows the host's bound).
- `triton`: `kernels/paged_attention.py`, fp32 online softmax, split-K, CUDA-graph capturable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlt_engine.kernels import kv_copy
from rlt_engine.models.attention import AttentionMetadata

if TYPE_CHECKING:  # the kernels are imported where they are used
    from rlt_engine.kernels.paged_attention import RopeWrite


@dataclass
class PagedMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [rows] int64: slot each row writes (the trash slot if idle)
    block_tables: torch.Tensor  # [seqs, width] int32: the table of the plane each seq reads
    seq_lens: torch.Tensor  # [seqs] int32: keys visible to the seq's last query
    query_start: torch.Tensor  # [seqs + 1] int32: seq s owns rows [start[s], start[s+1])
    max_query_len: int  # host bound (1 for decode)
    max_seq_len: int  # host bound on seq_lens (the torch backend's gather width)
    # prefill only, for the torch backend: (first row, rows, keys) per sequence, host ints
    chunks: tuple[tuple[int, int, int], ...] = ()


@dataclass
class MixedMetadata(AttentionMetadata):
    """Decode rows [0, split) and the rows of prompt chunks riding in the same traversal
    [split, rows): one K/V write over every row, then each part read by its own kernel (the
    parts are different sequences, so neither reads what the other writes)."""

    slot_mapping: torch.Tensor  # [rows] int64: both parts' slots, decode rows first
    decode: PagedMetadata
    chunks: PagedMetadata
    split: int


def _split_read(
    read: Callable[[int, torch.Tensor, PagedMetadata], torch.Tensor],
    layer: int,
    q: torch.Tensor,
    meta: PagedMetadata | MixedMetadata,
) -> torch.Tensor:
    """`read(layer, q, meta)` of a plain call, or of both parts of a mixed one."""
    if isinstance(meta, PagedMetadata):
        return read(layer, q, meta)
    n = meta.split
    return torch.cat([read(layer, q[:n], meta.decode), read(layer, q[n:], meta.chunks)])


class PagedKVCache:
    """Owns the K/V pool; `attend` is implemented by the backends below."""

    long_context = False  # decode tables may reach LONG_CONTEXT keys (Triton), per variant

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        num_heads: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.trash_slot = num_slots
        self.block_size = block_size
        self.group = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)

    # LAST_EXITED exit copies (kernels/kv_copy.py): the torch form here, one launch on Triton
    _copy_exits = staticmethod(kv_copy.exit_copies_reference)

    def exit_copies(
        self,
        exits: torch.Tensor,
        loop: torch.Tensor,
        block: torch.Tensor,
        offset: torch.Tensor,
        src: torch.Tensor,
        tables: torch.Tensor,
    ) -> None:
        """LAST_EXITED: each exiting row's K/V (every layer, at slot `src`) also goes to its
        position in every plane deeper than its loop (kernels/kv_copy.py)."""
        self._copy_exits(self.k, self.v, exits, loop, block, offset, src, tables, self.block_size)

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata | MixedMetadata
    ) -> None:
        slot_mapping = meta.slot_mapping
        self.k[layer, slot_mapping] = k
        self.v[layer, slot_mapping] = v


class TorchPagedAttention(PagedKVCache):
    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(meta, (PagedMetadata, MixedMetadata))
        self.write(layer, k, v, meta)
        return _split_read(self._read, layer, q, meta)

    def _read(self, layer: int, q: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        if meta.max_query_len == 1:
            return self._decode(layer, q, meta)
        out = torch.empty_like(q)
        for seq, (first, n, ctx) in enumerate(meta.chunks):
            slots = self._slots(meta.block_tables[seq : seq + 1], ctx)[0]
            keys, vals = self.k[layer, slots][None], self.v[layer, slots][None]
            # row i of the chunk sits at position ctx - n + i and sees keys [0, ctx - n + i]
            visible = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
            out[first : first + n] = self._attend(
                q[None, first : first + n], keys, vals, visible[None]
            )[0]
        return out

    def _slots(self, tables: torch.Tensor, ctx: int) -> torch.Tensor:
        """[seqs, ctx] flat slots of key positions [0, ctx) through each seq's table."""
        bs = self.block_size
        blocks = -(-ctx // bs)
        offsets = torch.arange(bs, device=tables.device)
        slots = tables[:, :blocks].long()[:, :, None] * bs + offsets
        return slots.flatten(1)[:, :ctx]

    def _decode(self, layer: int, q: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """One query per sequence (rows = seqs), batched, padded to the host's bound."""
        ctx = max(meta.max_seq_len, 1)
        slots = self._slots(meta.block_tables, ctx)
        keys, vals = self.k[layer, slots], self.v[layer, slots]  # [n, ctx, kvh, d]
        visible = torch.arange(ctx, device=q.device)[None, :] < meta.seq_lens[:, None]
        return self._attend(q.unsqueeze(1), keys, vals, visible[:, None, :])[:, 0]

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """q [b, n, h, d]; keys/vals [b, ctx, kvh, d]; visible [b, n, ctx] -> [b, n, h, d].
        Softmax statistics in fp32."""
        if self.group > 1:
            keys = keys.repeat_interleave(self.group, dim=2)
            vals = vals.repeat_interleave(self.group, dim=2)
        scores = torch.einsum("bnhd,bchd->bhnc", q.float(), keys.float()) * self.scale
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        return torch.einsum("bhnc,bchd->bnhd", probs, vals.float()).to(q.dtype)


class TritonPagedAttention(PagedKVCache):
    """The Triton kernel: reads K/V through the tables on the device, capturable."""

    def __init__(self, *args, **kwargs) -> None:
        from rlt_engine.kernels.paged_attention import SPLIT_SEQS

        super().__init__(*args, **kwargs)
        # decode split-K's arrival counters (zero between launches; the kernel resets them)
        self.split_counters = torch.zeros(
            SPLIT_SEQS * self.k.shape[2], dtype=torch.int32, device=self.k.device
        )

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata | MixedMetadata
    ) -> None:
        from rlt_engine.kernels.kv_write import write_kv_

        write_kv_(self.k[layer], self.v[layer], k, v, meta.slot_mapping)  # one launch for K and V

    def attend_rope(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """`attend` for q and k before RoPE, the same values as apply_rope_ then `attend`:
        one launch rotates them and writes K/V (kernels/rope_kv_write), or for decode rows
        on the rows kernel the attention launch itself (paged_attention's `rope_write`)."""
        from rlt_engine.kernels.paged_attention import RopeWrite
        from rlt_engine.kernels.rope_kv_write import rope_write_kv_

        assert isinstance(meta, (PagedMetadata, MixedMetadata))
        if isinstance(meta, PagedMetadata) and meta.max_query_len == 1:
            # no launch before attention (the qkv GEMM, or RoPE + the K/V write before the
            # tensor-core kernel) writes metadata: its K/V prefetch is safe
            new = RopeWrite(*rope, k, v, meta.slot_mapping)
            return self._read(layer, q, meta, prefetch_kv=True, rope_write=new)
        rope_write_kv_(q, k, v, *rope, self.k[layer], self.v[layer], meta.slot_mapping)
        if isinstance(meta, PagedMetadata):  # the K/V write just before writes no metadata
            return self._read(layer, q, meta, prefetch_kv=True)
        return self.attend(layer, q, k, v, meta, kv_written=True)

    def project_attend(
        self,
        layer: int,
        x: torch.Tensor,
        w_qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The packed qkv projection of decode rows x with RoPE and the K/V write in the
        GEMM's epilogue (kernels/ws_gemm.QkvRope: one launch and one PDL hop fewer), then
        attention: `attend_rope`'s values bit for bit. None where the small-GEMM table picks
        no warp-specialised kernel for the projection (prefill, larger batches, other
        devices): the caller projects and calls `attend_rope`."""
        from rlt_engine.kernels.small_gemm import linear_rope
        from rlt_engine.kernels.ws_gemm import QkvRope

        if not (isinstance(meta, PagedMetadata) and meta.max_query_len == 1):
            return None
        k_pool, v_pool = self.k[layer], self.v[layer]
        kv_heads, head_dim = k_pool.shape[1:]
        num_heads = w_qkv.shape[0] // head_dim - 2 * kv_heads
        epilogue = QkvRope(*rope, k_pool, v_pool, meta.slot_mapping, num_heads)
        qkv = linear_rope(x, w_qkv, epilogue)
        if qkv is None:
            return None
        q = qkv.view(x.shape[0], num_heads + 2 * kv_heads, head_dim)[:, :num_heads]
        return self._read(layer, q, meta, prefetch_kv=True)

    _copy_exits = staticmethod(kv_copy.exit_copies_)  # rows that stay move nothing

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:
        assert isinstance(meta, (PagedMetadata, MixedMetadata))
        if not kv_written:
            self.write(layer, k, v, meta)
        return _split_read(self._read, layer, q, meta)

    def _read(
        self,
        layer: int,
        q: torch.Tensor,
        meta: PagedMetadata,
        prefetch_kv: bool = False,
        rope_write: RopeWrite | None = None,
    ) -> torch.Tensor:
        from rlt_engine.kernels.paged_attention import decode_splits, paged_attention

        return paged_attention(
            q,
            self.k[layer],
            self.v[layer],
            meta.block_tables,
            meta.seq_lens,
            meta.query_start,
            block_size=self.block_size,
            scale=self.scale,
            max_query_len=meta.max_query_len,
            num_splits=(
                decode_splits(
                    meta.block_tables.shape[0],
                    self.long_context,
                    mha=q.shape[1] == self.k.shape[-2],
                )
                if meta.max_query_len == 1
                else 1
            ),
            long_context=self.long_context,
            prefetch_kv=prefetch_kv,
            rope_write=rope_write,
            split_counters=self.split_counters,
        )


def attention_backend(name: str, device: torch.device) -> type[PagedKVCache]:
    """Resolve `--attention-backend`: auto = triton on CUDA, torch elsewhere. An explicit
    choice that cannot run here is an error, never a silent fallback."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchPagedAttention
    if name == "triton":
        from rlt_engine.kernels.paged_attention import supported

        ok, why = supported(device)
        if not ok:
            raise ValueError(f"attention_backend=triton cannot run on {device}: {why}")
        return TritonPagedAttention
    if name == "flash":
        raise ValueError(
            "attention_backend=flash needs the flash-attn package's paged KV-cache API, "
            "which this build does not wire up yet; use triton or torch"
        )
    raise ValueError(f"unknown attention backend {name!r}")
