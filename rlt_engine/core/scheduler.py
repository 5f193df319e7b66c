"""Loop-level continuous batching. One `schedule()` = one stage batch.

A RECURRENT batch is one traversal of the shared layer stack; its rows are (request, loop,
positions) at mixed depths, since the weights are shared and only the KV plane differs. Decode
rows always ride in every traversal, so prefill can never starve decode; prefill chunks fill
the rest of the token budget in queue order.
- refill: a token that exits gets its CODA (lm_head + sampling) in the next step and rejoins
  at loop 0 right after, so nothing idles waiting for the slowest row.
- no-refill: exited tokens wait until the whole decode cohort has exited.
Memory and queue policies (admission, growth, priority, preemption) live in `admission.py`.
"""

from __future__ import annotations

import time

from rlt_engine.config import CacheConfig, SchedulerConfig
from rlt_engine.core.admission import Admission
from rlt_engine.core.block_manager import BlockManager
from rlt_engine.core.exit_rule import ExitTracker
from rlt_engine.core.plan import (
    CodaRow,
    KVCopy,
    RecurrentRow,
    Sample,
    Stage,
    StepPlan,
    StepResult,
)
from rlt_engine.core.request import Request


class Scheduler(Admission):
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        depth: int,
        cache: CacheConfig | None = None,
    ) -> None:
        super().__init__(config, cache or CacheConfig(), blocks, depth)
        self.trace: list[StepPlan] | None = None  # set to [] to record every plan
        self._planned: list[Request] = []  # requests behind the rows of the plan in flight
        self._touched: list[Request] = []  # requests whose device state that plan changes

    # -- planning ------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        self.admit()
        plan = self._coda_plan() or self._recurrent_plan()
        if plan is not None and self.trace is not None:
            self.trace.append(plan)
        return plan

    def bookkeeping_plan(self) -> StepPlan | None:
        """A plan without rows carrying pending worker operations (slot frees, snapshot
        drops, ...) for when no further step will run."""
        return self._finish_plan(Stage.RECURRENT, (), []) if self.has_pending_ops() else None

    def _coda_plan(self) -> StepPlan | None:
        ready = [r for r in self.running if r.stage is Stage.CODA]
        if not ready:
            return None
        if not self.config.refill and any(r.stage is Stage.RECURRENT for r in self.running):
            return None  # no-refill: the cohort samples together once every token exited
        rows = tuple(CodaRow(r.request_id, r.slot) for r in ready)  # type: ignore[arg-type]
        return self._finish_plan(Stage.CODA, rows, ready)

    def _recurrent_plan(self) -> StepPlan | None:
        rows: list[RecurrentRow] = []
        owners: list[Request] = []
        budget = self.config.max_num_batched_tokens
        # no-refill: a new token (PRELUDE) starts only when no cohort is between loops
        cohort_busy = not self.config.refill and any(
            r.stage is Stage.RECURRENT for r in self.running
        )
        # Best-first, so that growth preempts (worst-first) only requests not yet planned.
        for req in sorted(self.running, key=self.rank):
            if req.finished or req.snapshot is not None:
                continue  # preempted while this plan was being built
            ready = req.stage is Stage.RECURRENT or (req.stage is Stage.PRELUDE and not cohort_busy)
            if ready and self.ensure_capacity(req, req.decode_position + 1, planned=owners):
                rows.append(self._decode_row(req))
                owners.append(req)
                budget -= 1
        for req in sorted(self.running, key=self.rank):
            if req.stage is Stage.PREFILL and budget > 0 and req.snapshot is None:
                row = self._prefill_row(req, budget, owners)
                if row is not None:
                    rows.append(row)
                    owners.append(req)
                    budget -= row.num_tokens
        if not rows:
            return None
        return self._finish_plan(Stage.RECURRENT, tuple(rows), owners)

    def _finish_plan(self, stage: Stage, rows: tuple, owners: list[Request]) -> StepPlan:
        self._planned = owners
        copies = [*self._orphan_copies, *(c for r in self.running for c in r.pending_copies)]
        # Everyone whose device state this plan touches, in case the step fails.
        swapped_in = {op.slot for op in self._swap_ins}
        self._touched = [
            *owners,
            *(r for r in self.running if r.pending_copies or r.slot in swapped_in),
            *self._preempted_since_plan,
        ]
        for r in self.running:
            r.pending_copies = []
        plan = StepPlan(
            stage,
            rows,
            kv_copies=tuple(copies),
            swap_outs=tuple(self._swap_outs),
            slot_frees=tuple(self._slot_frees),
            slot_inits=tuple(self._slot_inits),
            swap_ins=tuple(self._swap_ins),
            snapshot_drops=tuple(self._snapshot_drops),
        )
        self.clear_pending_ops()
        return plan

    def _plane(self, loop: int) -> int:
        return 0 if self.shared else loop

    def _claim_writes(self, req: Request, loop: int, start: int, end: int) -> None:
        """A row reads positions [0, end) of its plane and writes [start, end): every earlier
        position must already hold K/V there (else the row would read an unwritten slot)."""
        plane = self._plane(loop)
        if req.written[plane] < start:
            raise RuntimeError(
                f"{req.request_id}: plane {plane} written up to {req.written[plane]}, "
                f"a row at position {start} would read unwritten KV"
            )
        req.written[plane] = max(req.written[plane], end)

    def _decode_row(self, req: Request) -> RecurrentRow:
        if req.stage is Stage.PRELUDE:
            req.stage, req.loop, req.tracker = Stage.RECURRENT, 0, ExitTracker(req.controls)
        pos = req.decode_position
        self._claim_writes(req, req.loop, pos, pos + 1)
        return RecurrentRow(
            request_id=req.request_id,
            slot=req.slot,  # type: ignore[arg-type]
            loop=req.loop,
            start=pos,
            num_tokens=1,
            token_ids=(req.output_token_ids[-1],) if req.loop == 0 else None,
            block_table=tuple(req.block_tables[self._plane(req.loop)]),  # type: ignore[index]
            # The last allowed loop always exits: sample in the same step. Earlier exits are
            # only known from the hazard, so they get a CODA step of their own.
            sample=req.loop + 1 >= req.controls.max_loops,
        )

    def _prefill_row(
        self, req: Request, budget: int, planned: list[Request]
    ) -> RecurrentRow | None:
        if req.chunk is None:
            remaining = req.prompt_len - req.num_prefilled
            # SHARED: a position must finish every loop before the next one reads it.
            limit = 1 if self.shared else self.config.prefill_chunk_size
            size = min(limit, remaining, budget)
            req.chunk, req.loop = (req.num_prefilled, req.num_prefilled + size), 0
        start, end = req.chunk
        if end - start > budget or not self.ensure_capacity(req, end, planned=planned):
            return None  # waits for a step with room for all its rows
        self._claim_writes(req, req.loop, start, end)
        return RecurrentRow(
            request_id=req.request_id,
            slot=req.slot,  # type: ignore[arg-type]
            loop=req.loop,
            start=start,
            num_tokens=end - start,
            token_ids=tuple(req.prompt_token_ids[start:end]) if req.loop == 0 else None,
            block_table=tuple(req.block_tables[self._plane(req.loop)]),  # type: ignore[index]
            sample=req.loop == self.depth - 1 and end == req.prompt_len,
        )

    def fail_plan(self) -> list[Request]:
        """The worker raised while executing the last plan: its effects on device state are
        unknown, so every request it touched is aborted (and nothing else is)."""
        touched, self._touched, self._planned = self._touched, [], []
        failed = []
        for req in touched:
            if not req.finished and req not in failed:
                self.finish(req, "abort")
                failed.append(req)
        return failed

    # -- results -------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Apply a step's results. Returns requests that received a token this step."""
        got_token = []
        owners, self._planned = self._planned, []
        for i, (row, req) in enumerate(zip(plan.rows, owners, strict=True)):
            if req.finished:
                continue  # aborted while the step ran: its result is stale
            sample = result.samples[i]
            if isinstance(row, CodaRow):
                self._accept_token(req, sample, req.tracker.loops_done)  # type: ignore[union-attr]
                got_token.append(req)
            elif req.stage is Stage.PREFILL:
                if self._advance_prefill(req, row, sample):
                    got_token.append(req)
            elif self._advance_decode(req, row, result.hazards[i], sample):
                got_token.append(req)
        return got_token

    def _advance_prefill(self, req: Request, row: RecurrentRow, sample: Sample | None) -> bool:
        if row.loop + 1 < self.depth:
            req.loop += 1
            return False
        req.num_prefilled, req.chunk, req.loop = row.start + row.num_tokens, None, 0
        self.blocks.commit_prefix(req.request_id, req.prompt_token_ids, req.num_prefilled)
        if req.num_prefilled < req.prompt_len:
            return False
        req.first_token_time = time.monotonic()
        self._accept_token(req, sample, self.depth)
        return True

    def _advance_decode(
        self, req: Request, row: RecurrentRow, hazard: float | None, sample: Sample | None
    ) -> bool:
        tracker = req.tracker
        assert tracker is not None
        if not tracker.step(hazard):
            req.loop += 1
            return False
        exit_loop = tracker.loops_done - 1
        if exit_loop + 1 < self.depth and not self.shared:
            self._plan_exit_copy(req, row.start, exit_loop)
        if sample is None:
            req.stage = Stage.CODA
            return False
        self._accept_token(req, sample, tracker.loops_done)
        return True

    def _plan_exit_copy(self, req: Request, pos: int, exit_loop: int) -> None:
        """LAST_EXITED: deeper loops read this token at its exit version."""
        tables = req.block_tables
        assert tables is not None
        deeper = range(exit_loop + 1, self.depth)
        for d in deeper:
            req.written[d] = max(req.written[d], pos + 1)
        req.pending_copies.append(
            KVCopy(
                self.blocks.slot(tables[exit_loop], pos),
                tuple(self.blocks.slot(tables[d], pos) for d in deeper),
            )
        )

    def _accept_token(self, req: Request, sample: Sample | None, depth: int) -> None:
        assert sample is not None, "the worker did not sample a row the plan asked for"
        req.output_token_ids.append(sample.token_id)
        req.exit_depths.append(depth)
        req.samples.append(sample)
        req.stage = Stage.PRELUDE
        if sample.token_id in req.stop_token_ids:
            self.finish(req, "stop")
        elif len(req.output_token_ids) >= req.params.max_tokens:
            self.finish(req, "length")
