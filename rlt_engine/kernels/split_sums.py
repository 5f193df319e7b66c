"""A split-K GEMM's output left for the kernel that reads it next to sum: `SplitSums`.

Why: a split-K GEMM's last split otherwise sums the partials itself, after drawing a ticket:
an acq_rel atomic, then a reload of every split's partial from L2, two dependent L2 round trips
at the end of the o_proj and the down_proj, on decode's critical path (the time lines of
results/2026-12-03-norm-in-gemm-h200.md: 1.5 us from their last MMA to their end, against 0.8
for the unsplit GEMMs). The add + norm launch that reads the output next (kernels/norm_chain)
loads the partials instead of y, in the one round trip it spends on y anyway, and sums them as
the GEMM would have: 0.0 + p0 + p1 + ... + p(S-1) in fp32, rounded once to the output dtype.
So every bit is the GEMM's own sum.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["SplitSums"]


class SplitSums(NamedTuple):
    """`parts`: fp32 [splits, rows, N], split s's partial product of a GEMM's K range; the
    GEMM's output is their sum in split order, rounded once to `dtype`."""

    parts: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        """The output's shape [rows, N]."""
        return self.parts.shape[1:]

    @property
    def device(self) -> torch.device:
        return self.parts.device

    def total(self) -> torch.Tensor:
        """The output [rows, N] in `dtype`, summed in the kernels' order (the reference)."""
        out = torch.zeros_like(self.parts[0])
        for part in self.parts:
            out += part
        return out.to(self.dtype)
