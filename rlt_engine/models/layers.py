"""Building blocks shared by the looped models (Hugging Face parameter names)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlt_engine.models.attention import AttentionBackend, AttentionMetadata
from rlt_engine.models.configs import LoopedLMConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


class RotaryEmbedding(nn.Module):
    """Half-rotation RoPE. Angles are always computed in fp32."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta), persistent=False)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        # `.to(torch.bfloat16)` would round inv_freq and shift every angle: recompute in fp32
        # (on the CPU, as the reference implementations do, then move it).
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta).to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [rows, heads, head_dim]; cos/sin: [rows, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: LoopedLMConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        rows = x.shape[0]
        q = self.q_proj(x).view(rows, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = backend.attend(self.layer, q, k, v, meta)
        return self.o_proj(out.reshape(rows, self.num_heads * self.head_dim))
