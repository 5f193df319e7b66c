"""A simple contiguous KV cache (one slot per (loop, layer, sequence, position)) and a greedy
decoder over it. It is the plain, obviously-correct way to run the model modules; the paged
engine is checked against it and against the dense oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlt_engine.core.exit_rule import ExitTracker, LoopControls
from rlt_engine.models.attention import AttentionMetadata
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.models.configs import LoopedLMConfig


@dataclass
class ContiguousMetadata(AttentionMetadata):
    seq_ids: torch.Tensor  # [rows] int64: which sequence of the cache a row belongs to


class ContiguousKVCache:
    """Implements `AttentionBackend`: K/V[loop, layer, seq, position]."""

    def __init__(
        self,
        cfg: LoopedLMConfig,
        max_seqs: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (cfg.num_loops, cfg.num_layers, max_seqs, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_loops = cfg.num_loops
        self.group = cfg.num_heads // cfg.num_kv_heads
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(meta, ContiguousMetadata)
        loops, seqs, pos = meta.loop_indices, meta.seq_ids, meta.positions
        self.k[loops, layer, seqs, pos] = k
        self.v[loops, layer, seqs, pos] = v
        out = torch.empty_like(q)
        groups = torch.stack((seqs, loops), dim=1).unique(dim=0).tolist()
        for seq, loop in groups:
            rows = ((seqs == seq) & (loops == loop)).nonzero().squeeze(1)
            row_pos = pos[rows]
            length = int(row_pos.max()) + 1
            keys = self.k[loop, layer, seq, :length].repeat_interleave(self.group, dim=1)
            vals = self.v[loop, layer, seq, :length].repeat_interleave(self.group, dim=1)
            scores = torch.einsum("nhd,lhd->hnl", q[rows].float(), keys.float()) * self.scale
            visible = torch.arange(length, device=q.device)[None, :] <= row_pos[:, None]
            probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
            out[rows] = torch.einsum("hnl,lhd->nhd", probs, vals.float()).to(q.dtype)
        return out

    def copy_to_deeper(self, seq: int, position: int, exit_loop: int) -> None:
        """A token that exited after loop `exit_loop` (0-based) is read at that version by
        every deeper loop (LAST_EXITED semantics)."""
        for deeper in range(exit_loop + 1, self.num_loops):
            self.k[deeper, :, seq, position] = self.k[exit_loop, :, seq, position]
            self.v[deeper, :, seq, position] = self.v[exit_loop, :, seq, position]


def _meta(positions: torch.Tensor, loop: int, seq: int) -> ContiguousMetadata:
    n = positions.shape[0]
    return ContiguousMetadata(
        positions=positions,
        loop_indices=torch.full((n,), loop, dtype=torch.long, device=positions.device),
        seq_ids=torch.full((n,), seq, dtype=torch.long, device=positions.device),
    )


@torch.inference_mode()
def greedy_decode(
    model: LoopedCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    controls: LoopControls | None = None,
) -> tuple[list[int], list[int]]:
    """Greedy decoding of one sequence. Returns (token ids, exit depth of each token).

    The prompt runs at full depth; the first token's exit depth is therefore the model depth.
    """
    depth = model.num_loops
    controls = controls or LoopControls(1, depth, 1.0)
    controls.validate(depth)
    device = model.lm_head.weight.device
    cache = ContiguousKVCache(
        model.config, 1, len(prompt_ids) + max_new_tokens, model.lm_head.weight.dtype, device
    )
    positions = torch.arange(len(prompt_ids), device=device)
    hidden = model.prelude(torch.tensor(prompt_ids, device=device))
    for loop in range(depth):
        hidden = model.recurrent(hidden, _meta(positions, loop, 0), cache).hidden
    tokens, depths = [int(model.coda(hidden[-1:]).argmax(-1))], [depth]
    while len(tokens) < max_new_tokens:
        position = len(prompt_ids) + len(tokens) - 1
        hidden = model.prelude(torch.tensor([tokens[-1]], device=device))
        tracker = ExitTracker(controls)
        pos = torch.tensor([position], device=device)
        for loop in range(depth):
            out = model.recurrent(hidden, _meta(pos, loop, 0), cache)
            hidden = out.hidden
            hazard = None if out.hazard is None else float(out.hazard[0])
            if tracker.step(hazard):
                break
        cache.copy_to_deeper(0, position, tracker.loops_done - 1)
        tokens.append(int(model.coda(hidden).argmax(-1)))
        depths.append(tracker.loops_done)
    return tokens, depths
