"""The Ouro objective: per-loop cross-entropy, the exit distribution from the gate's hazards,
the loss Σ_t p_t · CE_t - β · H(p), and stage 2's per-token stop targets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlt_engine.models.base import LoopedCausalLM


def gate_logits(model: LoopedCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """The exit gate before its sigmoid, in fp32 outside autocast: the same arithmetic as
    `LoopedCausalLM.exit_hazard` (hazard = sigmoid of this), kept in logit space so that
    log λ and log(1 - λ) stay finite when λ saturates."""
    gate = model.model.early_exit_gate
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(hidden.float(), gate.weight.float(), gate.bias.float()).squeeze(-1)


def loop_losses(
    model: LoopedCausalLM, hiddens: Sequence[torch.Tensor], targets: torch.Tensor
) -> torch.Tensor:
    """Per-token cross-entropy of each loop's read-out: [T_loops, rows], fp32."""
    flat = targets.reshape(-1)
    ce = [F.cross_entropy(model.coda(h).float(), flat, reduction="none") for h in hiddens]
    return torch.stack(ce)


def exit_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log p_t of the exit distribution from gate logits [T_loops, rows]: p_t = λ_t S_t for
    t < T-1, p_{T-1} = S_{T-1}, with S_t = Π_{i<t}(1 - λ_i) the mass still looping."""
    log_stop, log_go = F.logsigmoid(logits), F.logsigmoid(-logits)
    log_survive = torch.cumsum(log_go, 0) - log_go  # exclusive prefix sum: Σ_{i<t}
    return torch.cat((log_stop[:-1] + log_survive[:-1], log_survive[-1:]), 0)


@dataclass
class ObjectiveTerms:
    loss: torch.Tensor
    expected_ce: torch.Tensor
    entropy: torch.Tensor
    ce_per_loop: torch.Tensor  # [T_loops], detached
    exit_mass: torch.Tensor  # [T_loops] mean p_t, detached


def ouro_objective(ce: torch.Tensor, log_p: torch.Tensor, beta: float) -> ObjectiveTerms:
    """Σ_t p_t · CE_t - β · H(p), averaged over tokens."""
    p = log_p.exp()
    expected_ce = (p * ce).sum(0).mean()
    entropy = -(p * log_p).sum(0).mean()
    return ObjectiveTerms(
        loss=expected_ce - beta * entropy,
        expected_ce=expected_ce,
        entropy=entropy,
        ce_per_loop=ce.detach().mean(1),
        exit_mass=p.detach().mean(1),
    )


def gate_targets(ce: torch.Tensor, margin: float) -> torch.Tensor:
    """Stop labels for loops 0..T-2: 1 where no later loop lowers this token's CE by more than
    `margin` nats (running on would not help), else 0. Returns [T_loops - 1, rows]."""
    later = ce[1:].flip(0).cummin(0).values.flip(0)  # best CE over loops t+1..T-1
    return (ce[:-1] - later < margin).float()
