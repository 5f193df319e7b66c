"""Loop-level continuous batching. One `schedule()` = one stage batch.

A RECURRENT batch is one traversal of the shared layer stack; its rows are (request, loop,
positions) at mixed depths, since the weights are shared and only the KV plane differs. Decode
rows always ride in every traversal, so prefill can never starve decode; prefill chunks fill
the rest of the token budget, first come first served.
- refill: a token that exits gets its CODA (lm_head + sampling) in the next step and rejoins
  at loop 0 right after, so nothing idles waiting for the slowest row.
- no-refill: exited tokens wait until the whole decode cohort has exited.
"""

from __future__ import annotations

import time
from collections import deque

from rlt_engine.config import SchedulerConfig
from rlt_engine.core.block_manager import BlockManager
from rlt_engine.core.exit_rule import ExitTracker
from rlt_engine.core.plan import (
    CodaRow,
    KVCopy,
    RecurrentRow,
    Sample,
    SlotInit,
    Stage,
    StepPlan,
    StepResult,
)
from rlt_engine.core.request import Request


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, depth: int) -> None:
        self.config, self.blocks, self.depth = config, blocks, depth
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._slot_inits: list[SlotInit] = []
        self._slot_frees: list[int] = []
        self.trace: list[StepPlan] | None = None  # set to [] to record every plan
        self._planned: list[Request] = []  # requests behind the rows of the plan in flight

    # -- arrivals and departures -------------------------------------------------------
    def add(self, request: Request) -> None:
        if not self.blocks.can_ever_fit(request.max_positions):
            raise ValueError(
                f"request {request.request_id} needs "
                f"{self.blocks.blocks_needed(request.max_positions)} KV blocks for "
                f"{request.max_positions} positions but the pool has only "
                f"{self.blocks.num_blocks}; shorten the prompt or max_tokens, or enlarge the cache"
            )
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        for req in (*self.waiting, *self.running):
            if req.request_id == request_id:
                self.finish(req, "abort")
                return req
        return None

    def finish(self, req: Request, reason: str) -> None:
        if req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
            self.blocks.free(req.request_id)
            self._slot_frees.append(req.slot)  # type: ignore[arg-type]
            self._free_slots.append(req.slot)  # type: ignore[arg-type]
        req.stage, req.finish_reason, req.finish_time = Stage.FINISHED, reason, time.monotonic()
        req.block_tables, req.slot, req.pending_copies = None, None, []

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def take_slot_frees(self) -> list[int]:
        """Slots freed since the last plan (for a worker that will see no further plan)."""
        frees, self._slot_frees = self._slot_frees, []
        return frees

    # -- planning ------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        self._admit()
        plan = self._coda_plan() or self._recurrent_plan()
        if plan is not None and self.trace is not None:
            self.trace.append(plan)
        return plan

    def _admit(self) -> None:
        while self.waiting and self._free_slots:
            req = self.waiting[0]
            if not self.blocks.can_allocate(req.max_positions):
                break  # FCFS: no overtaking the head of the queue
            self.waiting.popleft()
            req.block_tables = self.blocks.allocate(req.request_id, req.max_positions)
            req.slot = self._free_slots.pop()
            req.stage = Stage.PREFILL
            req.written = [0] * self.depth
            self._slot_inits.append(SlotInit(req.slot, req.params, req.seed))
            self.running.append(req)

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
        for req in self.running:
            if req.stage is Stage.RECURRENT or (req.stage is Stage.PRELUDE and not cohort_busy):
                rows.append(self._decode_row(req))
                owners.append(req)
                budget -= 1
        for req in self.running:
            if req.stage is Stage.PREFILL and budget > 0:
                row = self._prefill_row(req, budget)
                if row is not None:
                    rows.append(row)
                    owners.append(req)
                    budget -= row.num_tokens
        if not rows:
            return None
        return self._finish_plan(Stage.RECURRENT, tuple(rows), owners)

    def _finish_plan(self, stage: Stage, rows: tuple, owners: list[Request]) -> StepPlan:
        self._planned = owners
        copies = tuple(c for r in self.running for c in r.pending_copies)
        for r in self.running:
            r.pending_copies = []
        plan = StepPlan(stage, rows, copies, tuple(self._slot_inits), tuple(self._slot_frees))
        self._slot_inits, self._slot_frees = [], []
        return plan

    def _claim_writes(self, req: Request, loop: int, start: int, end: int) -> None:
        """A row reads positions [0, end) of plane `loop` and writes [start, end): every earlier
        position must already hold K/V there (else the row would read an unwritten slot)."""
        if req.written[loop] < start:
            raise RuntimeError(
                f"{req.request_id}: plane {loop} written up to {req.written[loop]}, "
                f"a row at position {start} would read unwritten KV"
            )
        req.written[loop] = max(req.written[loop], end)

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
            block_table=tuple(req.block_tables[req.loop]),  # type: ignore[index]
            # The last allowed loop always exits: sample in the same step. Earlier exits are
            # only known from the hazard, so they get a CODA step of their own.
            sample=req.loop + 1 >= req.controls.max_loops,
        )

    def _prefill_row(self, req: Request, budget: int) -> RecurrentRow | None:
        if req.chunk is None:
            remaining = req.prompt_len - req.num_prefilled
            size = min(self.config.prefill_chunk_size, remaining, budget)
            req.chunk, req.loop = (req.num_prefilled, req.num_prefilled + size), 0
        start, end = req.chunk
        if end - start > budget:
            return None  # an in-flight chunk waits for a step with room for all its rows
        self._claim_writes(req, req.loop, start, end)
        return RecurrentRow(
            request_id=req.request_id,
            slot=req.slot,  # type: ignore[arg-type]
            loop=req.loop,
            start=start,
            num_tokens=end - start,
            token_ids=tuple(req.prompt_token_ids[start:end]) if req.loop == 0 else None,
            block_table=tuple(req.block_tables[req.loop]),  # type: ignore[index]
            sample=req.loop == self.depth - 1 and end == req.prompt_len,
        )

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
        exited = tracker.step(hazard)
        if not exited:
            req.loop += 1
            return False
        exit_loop = tracker.loops_done - 1
        if exit_loop + 1 < self.depth:
            tables = req.block_tables
            assert tables is not None
            pos = row.start
            deeper = range(exit_loop + 1, self.depth)
            for d in deeper:
                req.written[d] = max(req.written[d], pos + 1)
            req.pending_copies.append(
                KVCopy(
                    self.blocks.slot(tables[exit_loop], pos),
                    tuple(self.blocks.slot(tables[d], pos) for d in deeper),
                )
            )
        if sample is None:
            req.stage = Stage.CODA
            return False
        self._accept_token(req, sample, tracker.loops_done)
        return True

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
