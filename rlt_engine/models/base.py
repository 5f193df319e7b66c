"""The looped-LM protocol: prelude (embed) -> recurrent (one traversal of the shared stack) ->
coda (lm_head). Models never see requests or caches, only rows and an attention backend."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rlt_engine.kernels.argmax import Partials
from rlt_engine.models.attention import AttentionBackend, AttentionMetadata
from rlt_engine.models.configs import LoopedLMConfig
from rlt_engine.models.layers import RMSNorm, RotaryEmbedding


@dataclass
class RecurrentOutput:
    hidden: torch.Tensor  # [rows, hidden]: input of the row's next loop and of the coda
    hazard: torch.Tensor | None  # [rows] fp32 exit hazard of this loop; None without a gate


class LoopedModel(nn.Module):
    """`model.*` parameters: embeddings, the shared layer stack, the final norm, optional gate."""

    def __init__(self, cfg: LoopedLMConfig, make_layer: Callable[[LoopedLMConfig, int], nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        if cfg.has_exit_gate:
            self.early_exit_gate = nn.Linear(cfg.hidden_size, 1, bias=True)


class LoopedCausalLM(nn.Module):
    layer_class: Callable[[LoopedLMConfig, int], nn.Module]

    def __init__(self, config: LoopedLMConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LoopedModel(config, type(self).layer_class)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # the exit gate's (weight, bias) in fp32, converted once by use_fast_path
        self.exit_gate_fp32: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_loops(self) -> int:
        return self.config.num_loops

    def use_fast_path(self) -> None:
        """Packed q/k/v and gate/up weights (one GEMM each), the fused Triton norm, RoPE and
        SwiGLU-activation kernels, each residual add with the norm after it in one launch
        (the layers' `forward_chained`), RoPE with the K/V write in one launch where the
        backend offers `attend_rope`, and the small-M GEMM kernel for the weight GEMMs and
        lm_head where its table says it beats cuBLAS (kernels/small_gemm), and a table of
        RoPE's cos / sin over the model's context (one gather a step instead of seven launches;
        32 MB for Ouro-1.4B in bf16, built while the engine profiles its memory, so the KV
        pool is sized around it). Same function; the worker turns it on with the Triton
        backend."""
        from rlt_engine.models.layers import Attention, RMSNorm, SwiGLU

        for module in self.modules():
            if isinstance(module, Attention) and module.qkv is None:
                module.pack()
            if isinstance(module, SwiGLU) and module.gate_up is None:
                module.pack()
            if isinstance(module, Attention):
                module.fused_rope = True
            if isinstance(module, (Attention, SwiGLU)):
                module.small_gemm = True
            if isinstance(module, SwiGLU):
                module.fused_act = True
            if isinstance(module, RMSNorm):
                module.fused = True
        self.small_gemm_head = True
        self.chained_norms = True
        if self.config.has_exit_gate:  # converted once, not in every traversal (two launches)
            self.exit_gate_fp32 = self._exit_gate_fp32()
        # requests end within the context (prompt + max_tokens <= it: the engine refuses
        # more), so no position, a finished slot's included, reaches past it
        context = self.config.max_position_embeddings
        self.model.rotary_emb.precompute(context, self.lm_head.weight.dtype)

    def prelude(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    @property
    def embedding(self) -> torch.Tensor:
        """The prelude's table: prelude(ids) == embedding[ids] (callers may gather it)."""
        return self.model.embed_tokens.weight

    def rope_table(self, dtype: torch.dtype) -> torch.Tensor | None:
        """RoPE's precomputed [positions, 2, D] cos / sin rows in `dtype` (use_fast_path), or
        None: `recurrent` takes rows gathered from it as its `rope`."""
        return self.model.rotary_emb.tables.get(dtype)

    def first_norm(self) -> tuple[torch.Tensor, float] | None:
        """The first layer's input norm (weight, eps) where `recurrent` takes its output from
        the caller (`normed`: use_fast_path's chained norms), else None."""
        if not getattr(self, "chained_norms", False):
            return None
        norm = self.model.layers[0].input_layernorm
        return norm.weight, norm.eps

    def recurrent(
        self,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        normed: torch.Tensor | None = None,
    ) -> RecurrentOutput:
        """One traversal of the shared stack for rows that may sit at different loops. `rope`:
        the rows' cos / sin [rows, D] where the caller gathered them (else computed here);
        `normed`: `hidden` through the first layer's norm where the caller computed it (only
        where `first_norm` gives the norm)."""
        if rope is None:
            rope = self.model.rotary_emb(meta.positions, hidden.dtype)
        if getattr(self, "chained_norms", False):  # set by use_fast_path
            hidden, hazard = self._chained_layers(hidden, rope, meta, backend, normed)
            if hazard is not None:
                return RecurrentOutput(hidden, hazard)
        else:
            for layer in self.model.layers:
                hidden = layer(hidden, rope, meta, backend)
            if self.config.norm_every_loop:
                hidden = self.model.norm(hidden)
        return RecurrentOutput(hidden, self.exit_hazard(hidden))

    def _chained_layers(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        normed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer loop of the fast path: each layer also returns the first norm of the next
        layer (after the last, the final norm when it runs every loop), computed in the same
        launch as its last residual add. The same values as the plain loop bit for bit.
        Returns (hidden, the exit hazard or None): with the final norm every loop, the last
        launch also computes the exit gate's hazard (to a few ulps of `exit_hazard`'s)."""
        layers = self.model.layers
        h = layers[0].input_layernorm(hidden) if normed is None else normed
        hazard = None
        for i, layer in enumerate(layers):
            gate = None
            if i + 1 < len(layers):
                next_norm = layers[i + 1].input_layernorm
            else:
                next_norm = self.model.norm if self.config.norm_every_loop else None
                gate = self.exit_gate_fp32 if next_norm is not None else None
            hidden, h, hazard = layer.forward_chained(
                hidden, h, next_norm, rope, meta, backend, exit_gate=gate
            )
        return (hidden, None) if h is None else (h, hazard)

    def exit_hazard(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if not self.config.has_exit_gate:
            return None
        weight, bias = self.exit_gate_fp32 or self._exit_gate_fp32()
        logit = F.linear(hidden.float(), weight, bias)
        return torch.sigmoid(logit).squeeze(-1)

    def _exit_gate_fp32(self) -> tuple[torch.Tensor, torch.Tensor]:
        gate = self.model.early_exit_gate
        return gate.weight.float(), gate.bias.float()

    def coda(
        self, hidden: torch.Tensor, gate: torch.Tensor | None = None, greedy: bool = False
    ) -> torch.Tensor | Partials:
        """Logits of `hidden`. `gate` (fast path only): a zero-valued one-element tensor lets
        the lm_head GEMM skip its work; the logits are then undefined (no row needs them).
        `greedy` (fast path only): instead of the logits, their argmax as kernels/argmax's
        partials, from the lm_head's epilogue where its kernel has one."""
        if not self.config.norm_every_loop:
            hidden = self.model.norm(hidden)
        if greedy:
            from rlt_engine.kernels.small_gemm import linear_argmax

            return linear_argmax(hidden, self.lm_head.weight, gate)
        if getattr(self, "small_gemm_head", False):  # set by use_fast_path
            from rlt_engine.kernels.small_gemm import linear

            return linear(hidden, self.lm_head.weight, gate)
        return self.lm_head(hidden)
