"""The training forward: every loop over whole packed sequences with no cache, each loop
attending to its own K/V only (Ouro's training semantics: one KV slot per (loop, layer)), and
the training-only dropout hooks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rlt_engine.models.attention import AttentionMetadata
from rlt_engine.models.base import LoopedCausalLM


@dataclass
class PackedMetadata(AttentionMetadata):
    """Rows are `batch` sequences of `seq_len` tokens, flattened sequence-major."""

    batch: int = 1
    seq_len: int = 1


class CausalSDPABackend:
    """`AttentionBackend` for training and scoring: causal attention inside each sequence over
    the K/V of the current call only. Every loop is a separate call, so a loop sees its own
    K/V and no other loop's, as in Ouro training. No cache is kept."""

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(meta, PackedMetadata)
        b, t = meta.batch, meta.seq_len
        qs = q.view(b, t, *q.shape[1:]).transpose(1, 2)  # [B, heads, T, d]
        ks = k.view(b, t, *k.shape[1:]).transpose(1, 2)
        vs = v.view(b, t, *v.shape[1:]).transpose(1, 2)
        group = qs.shape[1] // ks.shape[1]
        if group > 1:  # GQA: each KV head serves `group` consecutive query heads
            ks = ks.repeat_interleave(group, dim=1)
            vs = vs.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        return out.transpose(1, 2).reshape(b * t, *q.shape[1:])


def loop_hiddens(
    model: LoopedCausalLM, input_ids: torch.Tensor, backend: CausalSDPABackend
) -> list[torch.Tensor]:
    """The normed hidden state after each loop, [B*T, H] each, for input ids [B, T]."""
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device).repeat(b)
    hidden = model.prelude(input_ids.reshape(-1))
    states = []
    for loop in range(model.num_loops):
        loops = torch.full_like(positions, loop)
        meta = PackedMetadata(positions=positions, loop_indices=loops, batch=b, seq_len=t)
        hidden = model.recurrent(hidden, meta, backend).hidden
        states.append(hidden)
    return states


def add_dropout(model: LoopedCausalLM, p: float) -> list[Any]:
    """Dropout on the embeddings and on each residual branch (after its sandwich norm, just
    before the residual add), as forward hooks: the model code stays the product's, and the
    hooks are inert in eval mode. GSM8K train is ~1.3M tokens, so a 5M-parameter model
    memorises it within a few epochs without this."""

    def hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return F.dropout(output, p, module.training)

    modules: list[torch.nn.Module] = [model.model.embed_tokens]
    for layer in model.model.layers:
        modules += [layer.input_layernorm_2, layer.post_attention_layernorm_2]
    return [m.register_forward_hook(hook) for m in modules] if p > 0 else []
