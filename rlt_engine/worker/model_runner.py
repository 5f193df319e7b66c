"""Executes `StepPlan`s: turns plain rows into tensors and runs prelude / recurrent / coda.

Per-slot device state (the hidden states of the unit in flight, the sampling generator) lives
here; the scheduler only ever sees integers.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from rlt_engine.core.plan import (
    CodaRow,
    RecurrentRow,
    Sample,
    Stage,
    StepPlan,
    StepResult,
    SwapIn,
    SwapOut,
)
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.sampling_params import SamplingParams
from rlt_engine.worker.paged_attention import PagedKVCache, PagedMetadata
from rlt_engine.worker.sampler import sample_rows


@dataclass
class _Snapshot:
    k: torch.Tensor  # [layers, slots of every owned block, kv_heads, head_dim]
    v: torch.Tensor
    hidden: torch.Tensor | None  # the unit in flight (prefill chunk or decode token)
    params: SamplingParams
    rng: torch.Tensor


class ModelRunner:
    def __init__(self, model: LoopedCausalLM, num_blocks: int, block_size: int) -> None:
        cfg = model.config
        self.model, self.block_size = model, block_size
        self.device = model.lm_head.weight.device
        self.kv = PagedKVCache(
            cfg.num_layers,
            num_blocks * block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.num_heads,
            model.lm_head.weight.dtype,
            self.device,
        )
        self.hidden: dict[int, torch.Tensor] = {}
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.snapshots: dict[int, _Snapshot] = {}  # preempted requests, in host memory

    def release(self, slots: list[int] | tuple[int, ...], snapshots: Iterable[int] = ()) -> None:
        for slot in slots:
            self.hidden.pop(slot, None)
            self.params.pop(slot, None)
            self.generators.pop(slot, None)
        for snapshot in snapshots:
            self.snapshots.pop(snapshot, None)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        if plan.kv_copies:
            src = [c.src for c in plan.kv_copies for _ in c.dst]
            dst = [d for c in plan.kv_copies for d in c.dst]
            self.kv.copy_slots(self._tensor(src), self._tensor(dst))
        for out in plan.swap_outs:
            self._swap_out(out)
        self.release(plan.slot_frees, plan.snapshot_drops)
        for init in plan.slot_inits:
            self.params[init.slot] = init.params
            self.generators[init.slot] = torch.Generator(self.device).manual_seed(init.seed)
        for swap_in in plan.swap_ins:
            self._swap_in(swap_in)
        if not plan.rows:
            return StepResult(hazards=(), samples=())
        if plan.stage is Stage.CODA:
            return self._coda(plan.rows)  # type: ignore[arg-type]
        return self._recurrent(plan.rows)  # type: ignore[arg-type]

    # -- preemption: every plane's pages and the slot's device state, exactly -----------
    def _block_slots(self, blocks: tuple[int, ...]) -> torch.Tensor:
        offsets = torch.arange(self.block_size, device=self.device)
        return (self._tensor(list(blocks))[:, None] * self.block_size + offsets).flatten()

    def _swap_out(self, op: SwapOut) -> None:
        slots = self._block_slots(op.blocks)
        self.snapshots[op.snapshot] = _Snapshot(
            k=self.kv.k[:, slots].to("cpu"),
            v=self.kv.v[:, slots].to("cpu"),
            hidden=self.hidden[op.slot].to("cpu") if op.slot in self.hidden else None,
            params=self.params[op.slot],
            rng=self.generators[op.slot].get_state(),
        )
        self.release([op.slot])

    def _swap_in(self, op: SwapIn) -> None:
        snap = self.snapshots.pop(op.snapshot)
        slots = self._block_slots(op.blocks)
        self.kv.k[:, slots] = snap.k.to(self.device)
        self.kv.v[:, slots] = snap.v.to(self.device)
        if snap.hidden is not None:
            self.hidden[op.slot] = snap.hidden.to(self.device)
        self.params[op.slot] = snap.params
        self.generators[op.slot] = torch.Generator(self.device)
        self.generators[op.slot].set_state(snap.rng)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _coda(self, rows: tuple[CodaRow, ...]) -> StepResult:
        last = torch.cat([self.hidden[r.slot][-1:] for r in rows])
        samples = self._sample(last, [r.slot for r in rows])
        return StepResult(hazards=(None,) * len(rows), samples=tuple(samples))

    def _sample(self, hidden: torch.Tensor, slots: list[int]) -> list[Sample]:
        logits = self.model.coda(hidden)
        return sample_rows(
            logits, [self.params[s] for s in slots], [self.generators[s] for s in slots]
        )

    def _recurrent(self, rows: tuple[RecurrentRow, ...]) -> StepResult:
        hidden = self._inputs(rows)
        meta = self._metadata(rows)
        out = self.model.recurrent(hidden, meta, self.kv)
        bounds = list(itertools.accumulate((r.num_tokens for r in rows), initial=0))
        starts, ends = bounds[:-1], bounds[1:]  # each row's span in the batch
        for r, s, e in zip(rows, starts, ends, strict=True):
            self.hidden[r.slot] = out.hidden[s:e]
        hazards: list[float | None] = [None] * len(rows)
        if out.hazard is not None:
            hazards = out.hazard[self._tensor(ends) - 1].tolist()
        samples: list[Sample | None] = [None] * len(rows)
        to_sample = [i for i, r in enumerate(rows) if r.sample]
        if to_sample:
            last = out.hidden[self._tensor([ends[i] - 1 for i in to_sample])]
            drawn = self._sample(last, [rows[i].slot for i in to_sample])
            for i, smp in zip(to_sample, drawn, strict=True):
                samples[i] = smp
        return StepResult(hazards=tuple(hazards), samples=tuple(samples))

    def _inputs(self, rows: tuple[RecurrentRow, ...]) -> torch.Tensor:
        ids = [t for r in rows if r.token_ids is not None for t in r.token_ids]
        embedded = self.model.prelude(self._tensor(ids)) if ids else None
        parts, offset = [], 0
        for r in rows:
            if r.token_ids is not None:  # loop 0: the prelude output is this row's input
                parts.append(embedded[offset : offset + r.num_tokens])  # type: ignore[index]
                offset += r.num_tokens
            else:
                parts.append(self.hidden[r.slot])
        return torch.cat(parts)

    def _metadata(self, rows: tuple[RecurrentRow, ...]) -> PagedMetadata:
        """Per-row tensors; slots are computed from block tables on the device, so the host
        work is per block, not per key position."""
        bs = self.block_size
        width = max(len(r.block_table) for r in rows)
        tables = self._tensor([[*r.block_table, *[0] * (width - len(r.block_table))] for r in rows])
        counts = [r.num_tokens for r in rows]
        row_of = torch.repeat_interleave(
            torch.arange(len(rows), device=self.device), self._tensor(counts)
        )
        positions = torch.cat([torch.arange(r.start, r.start + r.num_tokens) for r in rows])
        positions = positions.to(self.device)

        def slots(row_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return tables[row_ids, torch.div(pos, bs, rounding_mode="floor")] * bs + pos % bs

        ends = [r.start + r.num_tokens for r in rows]
        firsts = list(itertools.accumulate(counts, initial=0))[:-1]  # each row's first index
        single = [i for i, r in enumerate(rows) if r.num_tokens == 1]
        single_rows = single_slots = single_lens = None
        if single:
            idx = self._tensor(single)
            lens = self._tensor([ends[i] for i in single])
            keys = torch.arange(int(max(ends[i] for i in single)), device=self.device)
            # positions past a row's length read a padding slot; the mask hides them
            single_slots = slots(idx[:, None], keys[None, :])
            single_rows, single_lens = self._tensor([firsts[i] for i in single]), lens
        chunks = []
        for i, r in enumerate(rows):
            if r.num_tokens > 1:
                keys = torch.arange(ends[i], device=self.device)
                chunks.append((firsts[i], r.num_tokens, slots(torch.full_like(keys, i), keys)))
        return PagedMetadata(
            positions=positions,
            loop_indices=self._tensor([r.loop for r in rows])[row_of],
            slot_mapping=slots(row_of, positions),
            single_rows=single_rows,
            single_slots=single_slots,
            single_lens=single_lens,
            chunks=chunks,
        )
