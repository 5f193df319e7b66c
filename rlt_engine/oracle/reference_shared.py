"""Dense fp32 oracle for the SHARED KV layout (docs/kv-cache.md): one K/V plane per layer.

SHARED is NOT the model of the reference (`reference.py`, LAST_EXITED semantics); it is a
different, approximate function that trades exactness for D times less KV memory:

- tokens are processed strictly position by position: a position runs all of its loops
  before the next position starts;
- at loop d and layer l, token i attends to every earlier token j < i with the K/V that j
  wrote at layer l in ITS LAST loop (its exit loop e_j - 1; prompt tokens run all D loops,
  so their final version is loop D - 1), and to itself with its own loop-d K/V;
- every loop overwrites the token's slot, so only that final version remains for later
  tokens.

In the reference, token i at loop d reads the loop-d K/V of earlier tokens (or their exit
version when they exited before d). The two agree only when D == 1.

Plain functions over a Hugging Face state dict (no modules, no paged cache); only the small
numeric helpers of `reference.py` (RMSNorm, RoPE, MLP, exit rule) are shared with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlt_engine.models.configs import LoopedLMConfig
from rlt_engine.oracle.reference import (
    Constrain,
    ReferenceOutput,
    StateDict,
    _mlp,
    _norm,
    _rope,
    _rope_tables,
    edited_greedy,
    reference_exit_depth,
)
from rlt_engine.sampling_params import SamplingParams

__all__ = ["shared_forward", "shared_greedy"]


@dataclass
class _PositionOutput:
    """Everything one position produced, for each of the D loops it ran."""

    hidden: torch.Tensor  # [D, H]: the state lm_head reads at each loop
    hazards: torch.Tensor | None  # [D] fp32, None without a gate
    logits: torch.Tensor  # [D, V]
    k: torch.Tensor  # [D, L, Hkv, d]: the K this token wrote at each (loop, layer)
    v: torch.Tensor  # [D, L, Hkv, d]


class _SharedPlane:
    """The single KV plane: row j of layer l holds token j's final (exit-loop) K/V."""

    def __init__(self, cfg: LoopedLMConfig, capacity: int, device: torch.device) -> None:
        shape = (cfg.num_layers, capacity, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=torch.float32, device=device)
        self.v = torch.zeros(shape, dtype=torch.float32, device=device)
        self.length = 0  # positions committed so far

    def commit(self, out: _PositionOutput, exit_depth: int) -> None:
        """Keep the token's exit-loop version; deeper loops it may have run are discarded."""
        self.k[:, self.length] = out.k[exit_depth - 1]
        self.v[:, self.length] = out.v[exit_depth - 1]
        self.length += 1


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Hq, d] against every row of k/v [n, Hkv, d] (no mask: all rows are visible)."""
    groups = q.shape[0] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    probs = (torch.einsum("hd,nhd->hn", q, k) / math.sqrt(q.shape[-1])).softmax(dim=-1)
    return torch.einsum("hn,nhd->hd", probs, v)


def _shared_layer(
    sd: StateDict,
    cfg: LoopedLMConfig,
    layer: int,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    plane: _SharedPlane,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer for the current token x [1, H]; returns (x, its k, its v) for this loop."""
    p = f"model.layers.{layer}."
    a = _norm(sd, cfg, p + "input_layernorm", x)
    q = (a @ sd[p + "self_attn.q_proj.weight"].T).view(1, cfg.num_heads, cfg.head_dim)
    k = (a @ sd[p + "self_attn.k_proj.weight"].T).view(1, cfg.num_kv_heads, cfg.head_dim)
    v = (a @ sd[p + "self_attn.v_proj.weight"].T).view(1, cfg.num_kv_heads, cfg.head_dim)
    q, k = _rope(q, *rope), _rope(k, *rope)
    n = plane.length
    keys = torch.cat([plane.k[layer, :n], k])  # earlier tokens' final versions, then own K
    vals = torch.cat([plane.v[layer, :n], v])
    attn = _attend_one(q[0], keys, vals).reshape(1, -1) @ sd[p + "self_attn.o_proj.weight"].T
    if cfg.sandwich_norm:
        attn = _norm(sd, cfg, p + "input_layernorm_2", attn)
    x = x + attn
    mlp = _mlp(sd, layer, _norm(sd, cfg, p + "post_attention_layernorm", x))
    if cfg.sandwich_norm:
        mlp = _norm(sd, cfg, p + "post_attention_layernorm_2", mlp)
    return x + mlp, k[0], v[0]


def _run_position(
    sd: StateDict,
    cfg: LoopedLMConfig,
    token: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    plane: _SharedPlane,
) -> _PositionOutput:
    """Run the token at position `plane.length` through all D loops (nothing is committed)."""
    pos = plane.length
    rope_here = (rope[0][pos : pos + 1], rope[1][pos : pos + 1])
    h = sd["model.embed_tokens.weight"][token][None]
    hidden, hazards, logits, ks, vs = [], [], [], [], []
    for _ in range(cfg.num_loops):
        loop_k, loop_v = [], []
        for layer in range(cfg.num_layers):
            h, k, v = _shared_layer(sd, cfg, layer, h, rope_here, plane)
            loop_k.append(k)
            loop_v.append(v)
        normed = _norm(sd, cfg, "model.norm", h)
        if cfg.norm_every_loop:
            h = normed
        hidden.append(normed[0])
        logits.append((normed @ sd["lm_head.weight"].T)[0])
        if cfg.has_exit_gate:
            gate = normed @ sd["model.early_exit_gate.weight"].T + sd["model.early_exit_gate.bias"]
            hazards.append(torch.sigmoid(gate)[0, 0])
        ks.append(torch.stack(loop_k))
        vs.append(torch.stack(loop_v))
    return _PositionOutput(
        hidden=torch.stack(hidden),
        hazards=torch.stack(hazards) if cfg.has_exit_gate else None,
        logits=torch.stack(logits),
        k=torch.stack(ks),
        v=torch.stack(vs),
    )


def _prepare(
    state_dict: StateDict, cfg: LoopedLMConfig, capacity: int
) -> tuple[StateDict, tuple[torch.Tensor, torch.Tensor], _SharedPlane]:
    sd = {name: t.detach().to(torch.float32) for name, t in state_dict.items()}
    device = sd["model.embed_tokens.weight"].device
    cos, sin = _rope_tables(cfg, capacity)
    return sd, (cos.to(device), sin.to(device)), _SharedPlane(cfg, capacity, device)


def shared_forward(
    state_dict: StateDict,
    cfg: LoopedLMConfig,
    input_ids: Sequence[int] | torch.Tensor,
    exit_depths: Sequence[int] | None = None,
) -> ReferenceOutput:
    """SHARED-layout outputs of every token at every loop, computed position by position.

    `exit_depths` (1..D, default D) say which loop's K/V each token leaves in the plane for
    later tokens. Every token is still run through all D loops so that its outputs at every
    depth are reported; loops past its exit only affect its own outputs, never the plane.
    """
    ids = [int(t) for t in torch.as_tensor(input_ids, dtype=torch.long).flatten().tolist()]
    depth, num_tokens = cfg.num_loops, len(ids)
    exits = [depth] * num_tokens if exit_depths is None else [int(e) for e in exit_depths]
    if not ids:
        raise ValueError("input_ids is empty")
    if len(exits) != num_tokens or any(not 1 <= e <= depth for e in exits):
        raise ValueError(f"exit_depths must hold {num_tokens} values in 1..{depth}")
    sd, rope, plane = _prepare(state_dict, cfg, num_tokens)
    outs = []
    for token, exit_depth in zip(ids, exits, strict=True):
        outs.append(_run_position(sd, cfg, token, rope, plane))
        plane.commit(outs[-1], exit_depth)
    return ReferenceOutput(
        hidden=torch.stack([o.hidden for o in outs], dim=1),
        hazards=None if outs[0].hazards is None else torch.stack([o.hazards for o in outs], 1),
        logits=torch.stack([o.logits for o in outs], dim=1),
    )


def shared_greedy(
    state_dict: StateDict,
    cfg: LoopedLMConfig,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    min_loops: int = 1,
    max_loops: int | None = None,
    exit_threshold: float = 1.0,
    edits: SamplingParams | None = None,
    constrain: Constrain | None = None,
) -> tuple[list[int], list[int]]:
    """Greedy decoding under SHARED semantics; returns (tokens, the depth each came from).

    Conventions of `reference_greedy`: prompt tokens run full depth D and the first token
    comes from the last prompt token at depth D; each later token is fed back, its exit
    depth is chosen by the fp32 exit rule from its hazards, and the next token is read from
    that depth.
    """
    depth = cfg.num_loops
    max_loops = depth if max_loops is None else max_loops
    prompt = [int(t) for t in torch.as_tensor(prompt_ids).flatten().tolist()]
    if not prompt or max_new_tokens < 0:
        raise ValueError("need a non-empty prompt and max_new_tokens >= 0")
    if max_new_tokens == 0:
        return [], []
    sd, rope, plane = _prepare(state_dict, cfg, len(prompt) + max_new_tokens)
    for token in prompt:
        out = _run_position(sd, cfg, token, rope, plane)
        plane.commit(out, depth)
    tokens, depths = [edited_greedy(out.logits[depth - 1], prompt, [], edits, constrain)], [depth]
    while len(tokens) < max_new_tokens:
        out = _run_position(sd, cfg, tokens[-1], rope, plane)
        e = reference_exit_depth(
            out.hazards, min_loops=min_loops, max_loops=max_loops, exit_threshold=exit_threshold
        )
        plane.commit(out, e)
        tokens.append(edited_greedy(out.logits[e - 1], prompt, tokens, edits, constrain))
        depths.append(e)
    return tokens, depths
