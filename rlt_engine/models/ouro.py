"""Ouro (ByteDance): sandwich-norm layers looped `total_ut_steps` times, learned exit gate."""

from __future__ import annotations

import torch
from torch import nn

from rlt_engine.models.attention import AttentionBackend, AttentionMetadata
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.models.configs import LoopedLMConfig
from rlt_engine.models.layers import Attention, RMSNorm, SwiGLU, add_norm, add_norm_hazard


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
        """The fast path's form of `forward`: h = input_layernorm(x) comes in already computed;
        returns (the layer's output, next_norm of it, None) with every add-and-norm pair in one
        launch (layers.add_norm), or (output, None, None) without next_norm. Bit-identical to
        `forward` with fused norms. `exit_gate` (fp32 weight and bias, with next_norm): the
        last launch also computes the exit hazard of next_norm's output, returned third."""
        # the o_proj's and the down_proj's split-K partials are summed by the add + norm launch
        attn = self.self_attn(h, rope, meta, backend, unreduced=True)
        x, h = add_norm(attn, x, self.post_attention_layernorm, self.input_layernorm_2)
        out = self.mlp(h, unreduced=next_norm is not None)
        if next_norm is None:
            return self.post_attention_layernorm_2(out, residual=x), None, None
        if exit_gate is not None:
            return add_norm_hazard(out, x, next_norm, self.post_attention_layernorm_2, exit_gate)
        return *add_norm(out, x, next_norm, self.post_attention_layernorm_2), None


class OuroForCausalLM(LoopedCausalLM):
    layer_class = OuroDecoderLayer
