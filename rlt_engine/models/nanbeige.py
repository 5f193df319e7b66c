"""Nanbeige4.2: Llama-style pre-norm layers looped `num_loops` times, GQA, no exit gate."""

from __future__ import annotations

import torch
from torch import nn

from rlt_engine.models.attention import AttentionBackend, AttentionMetadata
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.models.configs import LoopedLMConfig
from rlt_engine.models.layers import Attention, RMSNorm, SwiGLU


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


class NanbeigeForCausalLM(LoopedCausalLM):
    layer_class = NanbeigeDecoderLayer
