"""Executes `StepPlan`s: turns plain rows into tensors and runs prelude / recurrent / coda.

Per-slot device state (the hidden states of the unit in flight, the sampling generator) lives
here; the scheduler only ever sees integers.
"""

from __future__ import annotations

import torch

from rlt_engine.core.plan import CodaRow, RecurrentRow, Sample, Stage, StepPlan, StepResult
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.sampling_params import SamplingParams
from rlt_engine.worker.paged_attention import PagedKVCache, PagedMetadata
from rlt_engine.worker.sampler import sample_rows


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

    def free_slots(self, slots: tuple[int, ...] | list[int]) -> None:
        for slot in slots:
            self.hidden.pop(slot, None)
            self.params.pop(slot, None)
            self.generators.pop(slot, None)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        self.free_slots(plan.slot_frees)
        for init in plan.slot_inits:
            self.params[init.slot] = init.params
            self.generators[init.slot] = torch.Generator(self.device).manual_seed(init.seed)
        if plan.kv_copies:
            src = [c.src for c in plan.kv_copies for _ in c.dst]
            dst = [d for c in plan.kv_copies for d in c.dst]
            self.kv.copy_slots(self._tensor(src), self._tensor(dst))
        if plan.stage is Stage.CODA:
            return self._coda(plan.rows)  # type: ignore[arg-type]
        return self._recurrent(plan.rows)  # type: ignore[arg-type]

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
        ends = torch.tensor([r.num_tokens for r in rows]).cumsum(0).tolist()
        starts = [e - r.num_tokens for e, r in zip(ends, rows, strict=True)]
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
        bs = self.block_size
        positions, loops, slots = [], [], []
        single_rows, single_slots, single_lens = [], [], []
        chunks = []
        for r in rows:
            first = len(positions)
            end = r.start + r.num_tokens
            key_slots = [r.block_table[p // bs] * bs + p % bs for p in range(end)]
            positions.extend(range(r.start, end))
            loops.extend([r.loop] * r.num_tokens)
            slots.extend(key_slots[r.start :])
            if r.num_tokens == 1:
                single_rows.append(first)
                single_slots.append(key_slots)
                single_lens.append(end)
            else:
                chunks.append((first, r.num_tokens, self._tensor(key_slots)))
        single = None
        if single_rows:
            width = max(single_lens)
            padded = [s + [s[0]] * (width - len(s)) for s in single_slots]
            single = (self._tensor(single_rows), self._tensor(padded), self._tensor(single_lens))
        return PagedMetadata(
            positions=self._tensor(positions),
            loop_indices=self._tensor(loops),
            slot_mapping=self._tensor(slots),
            single_rows=single[0] if single else None,
            single_slots=single[1] if single else None,
            single_lens=single[2] if single else None,
            chunks=chunks,
        )
