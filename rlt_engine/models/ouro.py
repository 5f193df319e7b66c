"""Ouro (ByteDance): sandwich-norm layers looped `total_ut_steps` times, learned exit gate."""

from __future__ import annotations

import torch
from torch import nn

from rlt_engine.models.attention import AttentionBackend, AttentionMetadata
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.models.configs import LoopedLMConfig
from rlt_engine.models.layers import Attention, RMSNorm, SwiGLU


class OuroDecoderLayer(nn.Module):
    def __init__(self, cfg: LoopedLMConfig, layer: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, layer)
        self.mlp = SwiGLU(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.input_layernorm_2 = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm_2 = RMSNorm(h, eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, meta, backend)
        x = self.input_layernorm_2(attn, residual=x)
        return self.post_attention_layernorm_2(
            self.mlp(self.post_attention_layernorm(x)), residual=x
        )


class OuroForCausalLM(LoopedCausalLM):
    layer_class = OuroDecoderLayer
