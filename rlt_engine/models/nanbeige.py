"""Nanbeige4.2: Llama-style pre-norm layers looped `num_loops` times, GQA, no exit gate."""

from __future__ import annotations

import torch
from torch import nn

from rlt_engine.models.attention import AttentionBackend, AttentionMetadata
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.models.configs import LoopedLMConfig
from rlt_engine.models.layers import Attention, RMSNorm, SwiGLU, add_norm


class NanbeigeDecoderLayer(nn.Module):
    def __init__(self, cfg: LoopedLMConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_chained(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        next_norm: RMSNorm | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        exit_gate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The fast path's form of `forward` (see OuroDecoderLayer.forward_chained): each
        residual add and the norm after it in one launch."""
        if exit_gate is not None:
            raise ValueError("Nanbeige has no exit gate")
        attn = self.self_attn(h, rope, meta, backend, unreduced=True)  # summed by add_norm
        x, h = add_norm(attn, x, self.post_attention_layernorm)
        out = self.mlp(h, unreduced=next_norm is not None)
        if next_norm is None:
            return x + out, None, None
        return *add_norm(out, x, next_norm), None


class NanbeigeForCausalLM(LoopedCausalLM):
    layer_class = NanbeigeDecoderLayer
