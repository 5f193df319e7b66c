"""The contract between model code and KV storage.

Model code computes q/k/v (RoPE applied) for a batch of rows and hands them to an
`AttentionBackend` together with per-row metadata. Each row carries its own loop index and
position, so one recurrent call can mix tokens at different loop depths; which KV plane a row
reads and writes is the backend's business, never the model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Per-row facts every backend receives. Backends subclass this with their own tensors."""

    positions: torch.Tensor  # [rows] int64: token position (does not advance per loop)
    loop_indices: torch.Tensor  # [rows] int64: loop this row is traversing (0-based)

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])


class AttentionBackend(Protocol):
    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [rows, num_heads, head_dim]
        k: torch.Tensor,  # [rows, num_kv_heads, head_dim]
        v: torch.Tensor,  # [rows, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Store this layer's k/v for every row, then return causal attention [rows, heads, dim].

        Rows of the same sequence and loop in one call see each other causally (prefill chunks).
        """
        ...
