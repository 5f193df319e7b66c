"""The two training stages over a batch stream: stage 1 trains the whole model on the Ouro
objective (keeping the weights with the best held-out CE), stage 2 fits the exit gate alone.
Logs every few steps to stdout and to `Trainer.log`."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from rlt_engine.models.base import LoopedCausalLM

from .backend import CausalSDPABackend, loop_hiddens
from .objective import (
    ObjectiveTerms,
    exit_log_probs,
    gate_logits,
    gate_targets,
    loop_losses,
    ouro_objective,
)
from .options import TrainOptions


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to `min_ratio` of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, opts: TrainOptions) -> torch.optim.Optimizer:
    # Weight decay on matrices only (not norms, not the gate bias).
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": opts.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95), eps=1e-8)


class Trainer:
    def __init__(self, opts: TrainOptions, model: LoopedCausalLM, device: torch.device) -> None:
        self.opts, self.model, self.device = opts, model, device
        self.backend = CausalSDPABackend()
        self.amp = opts.amp and device.type == "cuda"
        self.log: dict[str, list[dict[str, Any]]] = {"train": [], "val": [], "gate": []}
        self.start = time.perf_counter()
        self.best: tuple[float, int, dict[str, torch.Tensor]] | None = None

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp)

    def seconds(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return round(time.perf_counter() - self.start, 2)

    def forward(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-loop per-token CE [T_loops, rows], gate logits [T_loops, rows])."""
        batch = batch.to(self.device, non_blocking=True)
        with self.autocast():
            hiddens = loop_hiddens(self.model, batch[:, :-1], self.backend)
            ce = loop_losses(self.model, hiddens, batch[:, 1:])
        logits = torch.stack([gate_logits(self.model, h) for h in hiddens])
        return ce, logits

    def beta(self, step: int) -> float:
        frac = step / max(1, self.opts.steps - 1)
        return self.opts.beta + (self.opts.beta_final - self.opts.beta) * frac

    def stage1(self, batches: Iterator[torch.Tensor], val: torch.Tensor) -> None:
        opts, model = self.opts, self.model
        optim = make_optimizer(model, opts)
        for step in range(opts.steps):
            lr = opts.lr * lr_factor(step, opts.steps, opts.warmup, opts.min_lr_ratio)
            for group in optim.param_groups:
                group["lr"] = lr
            ce, logits = self.forward(next(batches))
            terms = ouro_objective(ce, exit_log_probs(logits), self.beta(step))
            optim.zero_grad(set_to_none=True)
            terms.loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), opts.grad_clip)
            optim.step()
            last = step == opts.steps - 1
            if step % opts.log_every == 0 or last:
                self.record_train(step, lr, terms, float(grad_norm))
            if (step + 1) % opts.eval_every == 0 or last:
                self.remember_best(step + 1, self.record_val("stage1", step + 1, val))
        if opts.keep_best and self.best is not None:
            ce, step, state = self.best
            model.load_state_dict(state)
            print(f"stage 1 ends with the weights of step {step} (val CE {ce:.4f})", flush=True)

    def remember_best(self, step: int, val_ce: list[float]) -> None:
        """Keep the weights with the lowest held-out CE at full depth (early stopping)."""
        if self.opts.keep_best and (self.best is None or val_ce[-1] < self.best[0]):
            state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self.best = (val_ce[-1], step, state)

    @property
    def best_step(self) -> int:
        return self.opts.steps if self.best is None else self.best[1]

    def stage2(self, batches: Iterator[torch.Tensor], val: torch.Tensor) -> None:
        """Gate only: the body is frozen, so its forward runs without autograd."""
        opts, model = self.opts, self.model
        gate = model.model.early_exit_gate
        optim = torch.optim.AdamW(gate.parameters(), lr=opts.gate_lr, weight_decay=0.0)
        model.eval()  # no dropout: the gate learns from the hiddens inference will see
        for step in range(opts.gate_steps):
            lr = opts.gate_lr * lr_factor(step, opts.gate_steps, 0, opts.min_lr_ratio)
            for group in optim.param_groups:
                group["lr"] = lr
            with torch.no_grad():
                batch = next(batches).to(self.device)
                with self.autocast():
                    hiddens = loop_hiddens(model, batch[:, :-1], self.backend)
                    ce = loop_losses(model, hiddens, batch[:, 1:])
                targets = gate_targets(ce, opts.gate_margin)
            logits = torch.stack([gate_logits(model, h) for h in hiddens[:-1]])
            loss = F.binary_cross_entropy_with_logits(logits, targets)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            last = step == opts.gate_steps - 1
            if step % opts.log_every == 0 or last:
                entry = {
                    "step": step,
                    "lr": lr,
                    "bce": float(loss.detach()),
                    "stop_target_rate": targets.mean(1).tolist(),
                    "hazard_mean": torch.sigmoid(logits).mean(1).tolist(),
                    "seconds": self.seconds(),
                }
                self.log["gate"].append(entry)
                print(f"[gate {step:5d}] bce {entry['bce']:.4f}  seconds {entry['seconds']}")
                sys.stdout.flush()
        self.record_val("stage2", opts.gate_steps, val)

    def record_train(self, step: int, lr: float, terms: ObjectiveTerms, grad_norm: float) -> None:
        entry = {
            "step": step,
            "lr": lr,
            "loss": float(terms.loss.detach()),
            "expected_ce": float(terms.expected_ce.detach()),
            "entropy": float(terms.entropy.detach()),
            "ce_per_loop": [round(float(x), 4) for x in terms.ce_per_loop],
            "exit_mass": [round(float(x), 4) for x in terms.exit_mass],
            "grad_norm": grad_norm,
            "seconds": self.seconds(),
        }
        self.log["train"].append(entry)
        ce = " ".join(f"{x:.3f}" for x in entry["ce_per_loop"])
        mass = " ".join(f"{x:.2f}" for x in entry["exit_mass"])
        print(
            f"[step {step:5d}] loss {entry['loss']:.4f}  ce/loop {ce}  exit mass {mass}  "
            f"lr {lr:.2e}  seconds {entry['seconds']}",
            flush=True,
        )

    @torch.no_grad()
    def record_val(self, stage: str, step: int, val: torch.Tensor) -> list[float]:
        """Held-out CE per loop and mean exit mass; returns the CE per loop."""
        training = self.model.training
        self.model.eval()
        ce_sum = torch.zeros(self.model.num_loops, device=self.device)
        mass_sum = torch.zeros_like(ce_sum)
        rows = 0
        for i in range(0, val.shape[0], self.opts.batch_size):
            ce, logits = self.forward(val[i : i + self.opts.batch_size])
            ce_sum += ce.sum(1)
            mass_sum += exit_log_probs(logits).exp().sum(1)
            rows += ce.shape[1]
        self.model.train(training)
        entry = {
            "stage": stage,
            "step": step,
            "ce_per_loop": [round(float(x), 4) for x in ce_sum / rows],
            "exit_mass": [round(float(x), 4) for x in mass_sum / rows],
            "tokens": rows,
            "seconds": self.seconds(),
        }
        self.log["val"].append(entry)
        ce_text = " ".join(f"{x:.3f}" for x in entry["ce_per_loop"])
        mass = " ".join(f"{x:.2f}" for x in entry["exit_mass"])
        print(f"[val {stage} {step}] ce/loop {ce_text}  exit mass {mass}", flush=True)
        return entry["ce_per_loop"]
