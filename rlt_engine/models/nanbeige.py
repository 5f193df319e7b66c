"""Nanbeige4.2: Llama-style pre-norm layers looped `num_loops` times, GQA, no exit gate."""

from __future__ import annotations

import torch
from torch import nn

from rlt_engine.models.attention import AttentionBackend, AttentionMetadata
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.models.configs import LoopedLMConfig
from rlt_engine.models.layers import Attention, RMSNorm, SwiGLU, add_norm, project_add_norm


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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fast path's form of `forward` (see OuroDecoderLayer.forward_chained): each
        residual add and the norm after it in one launch."""
        attn, mlp = self.self_attn, self.mlp
        heads = attn(h, rope, meta, backend, project_out=False)
        x, h = project_add_norm(
            heads,
            attn.o_proj.weight,
            x,
            self.post_attention_layernorm,
            small_gemm=attn.small_gemm,
            prefetch_whole=True,
        )
        if mlp.gate_up is None or next_norm is None:
            out = mlp(h)
            return (x + out, None) if next_norm is None else add_norm(out, x, next_norm)
        return project_add_norm(
            mlp.activation(h), mlp.down_proj.weight, x, next_norm, small_gemm=mlp.small_gemm
        )


class NanbeigeForCausalLM(LoopedCausalLM):
    layer_class = NanbeigeDecoderLayer
