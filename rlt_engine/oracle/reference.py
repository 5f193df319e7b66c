"""Dense fp32 oracle for looped LMs, written straight from the model facts (docs/kv-cache.md).

Plain functions over a Hugging Face state dict: no modules, no KV cache, nothing shared with
the production model code, so that agreement between the two means something. Every token is
recomputed through every loop; per-token exit depths are honoured the LAST_EXITED way (a token
that exited at depth e lends its loop e-1 K/V to every deeper loop).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlt_engine.models.configs import LoopedLMConfig
from rlt_engine.sampling_params import SamplingParams

StateDict = dict[str, torch.Tensor]


@dataclass
class ReferenceOutput:
    hidden: torch.Tensor  # [D, T, H]: the state lm_head reads at each loop
    hazards: torch.Tensor | None  # [D, T] fp32 exit-gate hazards, None without a gate
    logits: torch.Tensor  # [D, T, V] fp32


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope_tables(cfg: LoopedLMConfig, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    hd = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    freqs = torch.outer(torch.arange(num_tokens, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, hd]
    return emb.cos()[:, None, :], emb.sin()[:, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, d], k/v [T, Hkv, d] -> [T, Hq, d], causal, GQA by repeating KV heads."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    t = q.shape[0]
    future = torch.triu(torch.ones(t, t, dtype=torch.bool, device=q.device), diagonal=1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _attention_block(
    sd: StateDict,
    cfg: LoopedLMConfig,
    layer: int,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    frozen: torch.Tensor,
    prev_kv: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Self-attention of one layer; rows in `frozen` (already exited) reuse `prev_kv`."""
    p = f"model.layers.{layer}.self_attn."
    t = x.shape[0]
    q = (x @ sd[p + "q_proj.weight"].T).view(t, cfg.num_heads, cfg.head_dim)
    k = (x @ sd[p + "k_proj.weight"].T).view(t, cfg.num_kv_heads, cfg.head_dim)
    v = (x @ sd[p + "v_proj.weight"].T).view(t, cfg.num_kv_heads, cfg.head_dim)
    q, k = _rope(q, *rope), _rope(k, *rope)
    if prev_kv is not None:
        # LAST_EXITED: an exited token's K/V at this loop is the copy of its last loop's K/V.
        mask = frozen[:, None, None]
        k = torch.where(mask, prev_kv[0], k)
        v = torch.where(mask, prev_kv[1], v)
    out = _causal_attention(q, k, v).reshape(t, cfg.num_heads * cfg.head_dim)
    return out @ sd[p + "o_proj.weight"].T, (k, v)


def _mlp(sd: StateDict, layer: int, x: torch.Tensor) -> torch.Tensor:
    p = f"model.layers.{layer}.mlp."
    gate = F.silu(x @ sd[p + "gate_proj.weight"].T)
    return (gate * (x @ sd[p + "up_proj.weight"].T)) @ sd[p + "down_proj.weight"].T


def _norm(sd: StateDict, cfg: LoopedLMConfig, name: str, x: torch.Tensor) -> torch.Tensor:
    return _rms_norm(x, sd[name + ".weight"], cfg.rms_norm_eps)


def _layer(
    sd: StateDict,
    cfg: LoopedLMConfig,
    layer: int,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    frozen: torch.Tensor,
    prev_kv: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    p = f"model.layers.{layer}."
    attn, kv = _attention_block(
        sd, cfg, layer, _norm(sd, cfg, p + "input_layernorm", x), rope, frozen, prev_kv
    )
    if cfg.sandwich_norm:
        attn = _norm(sd, cfg, p + "input_layernorm_2", attn)
    x = x + attn
    mlp = _mlp(sd, layer, _norm(sd, cfg, p + "post_attention_layernorm", x))
    if cfg.sandwich_norm:
        mlp = _norm(sd, cfg, p + "post_attention_layernorm_2", mlp)
    return x + mlp, kv


def reference_forward(
    state_dict: StateDict,
    cfg: LoopedLMConfig,
    input_ids: Sequence[int] | torch.Tensor,
    exit_depths: Sequence[int] | None = None,
) -> ReferenceOutput:
    """Run every token through all D loops; `exit_depths` (1..D) only shape whose K/V is read."""
    sd = {name: t.detach().to(torch.float32) for name, t in state_dict.items()}
    ids = torch.as_tensor(input_ids, dtype=torch.long).flatten()
    depth, num_tokens = cfg.num_loops, ids.shape[0]
    exits = torch.full((num_tokens,), depth) if exit_depths is None else torch.tensor(exit_depths)
    if exits.shape != (num_tokens,) or bool(((exits < 1) | (exits > depth)).any()):
        raise ValueError(f"exit_depths must hold {num_tokens} values in 1..{depth}")
    device = sd["model.embed_tokens.weight"].device
    ids, exits = ids.to(device), exits.to(device)
    rope = tuple(t.to(device) for t in _rope_tables(cfg, num_tokens))

    h = sd["model.embed_tokens.weight"][ids]
    kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * cfg.num_layers
    hidden, hazards, logits = [], [], []
    for loop in range(depth):
        frozen = exits <= loop
        for layer in range(cfg.num_layers):
            h, kv[layer] = _layer(sd, cfg, layer, h, rope, frozen, kv[layer])
        normed = _norm(sd, cfg, "model.norm", h)
        if cfg.norm_every_loop:
            h = normed  # Ouro and default Nanbeige: the normed state feeds the next loop
        hidden.append(normed)
        logits.append(normed @ sd["lm_head.weight"].T)
        if cfg.has_exit_gate:
            gate = normed @ sd["model.early_exit_gate.weight"].T + sd["model.early_exit_gate.bias"]
            hazards.append(torch.sigmoid(gate).squeeze(-1))
    return ReferenceOutput(
        hidden=torch.stack(hidden),
        hazards=torch.stack(hazards) if cfg.has_exit_gate else None,
        logits=torch.stack(logits),
    )


def reference_exit_depth(
    hazards: torch.Tensor | None, *, min_loops: int, max_loops: int, exit_threshold: float
) -> int:
    """Loops a token runs under the fp32 exit rule, given its per-loop hazards (None: no gate)."""
    threshold = torch.tensor(exit_threshold, dtype=torch.float32)
    remaining = torch.ones((), dtype=torch.float32)
    for t in range(max_loops):
        loops_done = t + 1
        if loops_done >= max_loops:
            break
        if hazards is None:
            continue
        remaining = remaining * (1 - hazards[t].to(device="cpu", dtype=torch.float32))
        cdf = 1 - remaining
        if bool(threshold < 1) and loops_done >= min_loops and bool(cdf >= threshold):
            return loops_done
    return max_loops


def reference_greedy(
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
    """Greedy decoding by full recomputation; returns (tokens, the depth each came from).
    `edits`: params whose logit bias, penalties and min_tokens apply (`edited_greedy`; None:
    none); `constrain`: a grammar's mask, applied after them."""
    depth = cfg.num_loops
    max_loops = depth if max_loops is None else max_loops
    tokens = [int(t) for t in torch.as_tensor(prompt_ids).flatten().tolist()]
    prompt = list(tokens)
    kv_depths = [depth] * len(tokens)  # prompt tokens always run full depth
    out = reference_forward(state_dict, cfg, tokens, kv_depths)
    generated = [edited_greedy(out.logits[depth - 1, -1], prompt, [], edits, constrain)]
    out_depths = [depth]
    while len(generated) < max_new_tokens:
        tokens.append(generated[-1])
        # The newest token's own depth does not affect its own outputs: run it to D.
        out = reference_forward(state_dict, cfg, tokens, [*kv_depths, depth])
        hazards = None if out.hazards is None else out.hazards[:, -1]
        e = reference_exit_depth(
            hazards, min_loops=min_loops, max_loops=max_loops, exit_threshold=exit_threshold
        )
        kv_depths.append(e)
        generated.append(edited_greedy(out.logits[e - 1, -1], prompt, generated, edits, constrain))
        out_depths.append(e)
    return generated[:max_new_tokens], out_depths[:max_new_tokens]


# structured output in the oracles: (fp32 logits of the next token, the output so far) -> the
# logits with the tokens its grammar leaves out at -inf (the tests drive a grammar matcher)
Constrain = Callable[[torch.Tensor, list[int]], torch.Tensor]


def edited_greedy(
    logits: torch.Tensor,
    prompt: list[int],
    output: list[int],
    edits: SamplingParams | None,
    constrain: Constrain | None = None,
) -> int:
    """The greedy token of fp32 `logits` after the logit bias, the penalties and min_tokens,
    token by token: each bias added, then repetition on each token seen in the prompt or the
    output, then frequency x its count and presence on each output token; while the output is
    shorter than min_tokens, its stop token ids are out (the sampler's `apply_logit_edits` for
    one row, written apart from it). The oracle knows only the explicit `stop_token_ids`, so
    min_tokens needs `ignore_eos` (the model's EOS and chat end token are the engine's)."""
    if constrain is not None:
        logits = constrain(logits.to(torch.float32).clone(), output)
    if edits is None:
        return int(logits.argmax())
    if edits.holds_back_stops and not edits.ignore_eos:
        raise ValueError("the oracle's min_tokens needs ignore_eos and explicit stop_token_ids")
    presence, frequency, repetition = (
        torch.tensor(p, dtype=torch.float32)
        for p in (edits.presence_penalty, edits.frequency_penalty, edits.repetition_penalty)
    )
    logits = logits.to(torch.float32).clone()
    for t, bias in edits.logit_bias:
        logits[t] = logits[t] + torch.tensor(bias, dtype=torch.float32)
    if bool(repetition != 1):
        for t in set(prompt) | set(output):
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
    for t in set(output):
        count = torch.tensor(output.count(t), dtype=torch.float32)
        logits[t] = logits[t] - frequency * count
        logits[t] = logits[t] - presence
    if len(output) < edits.min_tokens:
        for t in edits.stop_token_ids or ():
            logits[t] = -math.inf
    return int(logits.argmax())
