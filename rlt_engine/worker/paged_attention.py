"""Torch attention backend over the paged, depth-aware KV cache (any device).

The cache holds K and V as [layers, num_blocks * block_size, kv_heads, head_dim] (flat slots).
Each row writes its K/V into its own slot and reads positions [0, pos] through the block table
of the plane its loop selects; the runner resolves tables into slot indices before the call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlt_engine.models.attention import AttentionMetadata


@dataclass
class PagedMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [rows]: flat slot each row writes
    # Single-token rows batched together: their row indices, key slots [n, max_ctx] and lengths.
    single_rows: torch.Tensor | None
    single_slots: torch.Tensor | None
    single_lens: torch.Tensor | None
    # Multi-token rows (prefill chunks): (first row, num rows, key slots [ctx]) each.
    chunks: list[tuple[int, int, torch.Tensor]]


class PagedKVCache:
    """Owns the K/V pool and implements `AttentionBackend` for `PagedMetadata`."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        num_heads: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.group = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """K/V of every layer from slots `src` to slots `dst` (exit copies into deeper planes)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(meta, PagedMetadata)
        self.k[layer, meta.slot_mapping] = k
        self.v[layer, meta.slot_mapping] = v
        out = torch.empty_like(q)
        if meta.single_rows is not None:
            rows = meta.single_rows
            keys = self.k[layer, meta.single_slots]  # [n, ctx, kvh, d]
            vals = self.v[layer, meta.single_slots]
            ctx = keys.shape[1]
            visible = torch.arange(ctx, device=q.device)[None, :] < meta.single_lens[:, None]
            out[rows] = self._attend(q[rows].unsqueeze(1), keys, vals, visible[:, None, :])[:, 0]
        for first, n, slots in meta.chunks:
            keys, vals = self.k[layer, slots][None], self.v[layer, slots][None]
            ctx = slots.shape[0]
            # row i of the chunk sits at position ctx - n + i and sees keys [0, ctx - n + i]
            visible = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
            out[first : first + n] = self._attend(
                q[None, first : first + n], keys, vals, visible[None]
            )[0]
        return out

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
