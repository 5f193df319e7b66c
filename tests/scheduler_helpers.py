"""Shared by the scheduler unit tests (tests/core/test_scheduler_*.py): pure Python, no torch.

`FakeWorker` plays the model. It keeps a ledger of which (request, position, loop version) each
KV slot holds, applies the plan's KV copies, and checks that every row only reads slots that
hold the right token at the LAST_EXITED version min(loop, exit loop). Hazards and sampled
tokens are deterministic functions of (request, loop, position).
"""

from __future__ import annotations

from collections.abc import Callable

from rlt_engine.config import CacheConfig, SchedulerConfig
from rlt_engine.core.block_manager import BlockManager
from rlt_engine.core.exit_rule import ExitTracker, LoopControls
from rlt_engine.core.plan import (
    CodaRow,
    RecurrentRow,
    Sample,
    Stage,
    StepPlan,
    StepResult,
)
from rlt_engine.core.request import Request
from rlt_engine.core.scheduler import Scheduler
from rlt_engine.sampling_params import SamplingParams

DEPTH = 4

Hazard = Callable[[str, int, int], float | None]  # (request id, loop, position) -> hazard


def make_scheduler(
    *,
    depth: int = DEPTH,
    block_size: int = 2,
    num_blocks: int = 256,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    prefill_chunk_size: int = 64,
    refill: bool = True,
    kv_layout: str = "last_exited",
    enable_prefix_caching: bool = False,
    incremental_kv: bool = False,
    watermark: float = 0.0,
    scheduling_policy: str = "fcfs",
    enable_preemption: bool = False,
    max_bypass: int = 32,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        prefill_chunk_size=prefill_chunk_size,
        refill=refill,
        scheduling_policy=scheduling_policy,
        enable_preemption=enable_preemption,
        max_bypass=max_bypass,
    )
    cache = CacheConfig(
        block_size=block_size,
        kv_layout=kv_layout,
        enable_prefix_caching=enable_prefix_caching,
        incremental_kv=incremental_kv,
        watermark=watermark,
        num_blocks=num_blocks,
    )
    planes = 1 if kv_layout == "shared" else depth
    blocks = BlockManager(num_blocks, block_size, planes, enable_prefix_caching)
    return Scheduler(config, blocks, depth, cache)


def make_request(
    rid: str,
    prompt_len: int = 3,
    max_tokens: int = 4,
    *,
    min_loops: int = 1,
    max_loops: int = DEPTH,
    threshold: float = 1.0,
    stop: tuple[int, ...] = (),
) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=[10 + i for i in range(prompt_len)],
        params=SamplingParams(max_tokens=max_tokens),
        controls=LoopControls(min_loops, max_loops, threshold),
        stop_token_ids=frozenset(stop),
        seed=0,
    )


def token_for(rid: str, position: int) -> int:
    """The token the fake model samples after running `position` of request `rid`."""
    return 100 + (position * 7 + sum(map(ord, rid))) % 50


class FakeWorker:
    def __init__(self, sched: Scheduler, hazard: Hazard = lambda rid, loop, pos: 0.0) -> None:
        self.sched, self.hazard = sched, hazard
        self.kv: dict[int, tuple[str, int, int]] = {}  # slot -> (request, position, version)
        self.requests: dict[str, Request] = {}
        self.exit_loop: dict[tuple[str, int], int] = {}  # (request, position) -> 0-based
        self.pending_coda: dict[str, int] = {}  # request -> position awaiting its CODA
        self.plans: list[StepPlan] = []
        self.tables: dict[tuple[str, int], tuple[int, ...]] = {}  # (request, plane) -> table

    def track(self, req: Request) -> Request:
        self.requests[req.request_id] = req
        return req

    def expected_exit_loop(self, rid: str, pos: int) -> int:
        """0-based loop after which the token at `pos` exits, from the fp32 rule."""
        req = self.requests[rid]
        if pos < req.prompt_len:
            return self.sched.depth - 1  # prompt tokens always run full depth
        tracker = ExitTracker(req.controls)
        while not tracker.step(self.hazard(rid, tracker.loops_done, pos)):
            pass
        return tracker.loops_done - 1

    def _slot(self, table: tuple[int, ...], pos: int) -> int:
        bs = self.sched.blocks.block_size
        return table[pos // bs] * bs + pos % bs

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for copy in plan.kv_copies:
            for dst in copy.dst:
                self.kv[dst] = self.kv[copy.src]
        if plan.stage is Stage.CODA:
            samples = []
            for row in plan.rows:
                assert isinstance(row, CodaRow)
                pos = self.pending_coda.pop(row.request_id)
                samples.append(Sample(token_for(row.request_id, pos)))
            return StepResult(hazards=(None,) * len(plan.rows), samples=tuple(samples))
        assert plan.stage is Stage.RECURRENT
        assert plan.num_tokens <= self.sched.config.max_num_batched_tokens
        assert len({r.request_id for r in plan.rows}) == len(plan.rows), "one row per request"
        hazards, samples = [], []
        for row in plan.rows:
            assert isinstance(row, RecurrentRow)
            hazards.append(self._run_row(row))
            end = row.start + row.num_tokens
            samples.append(Sample(token_for(row.request_id, end - 1)) if row.sample else None)
        return StepResult(hazards=tuple(hazards), samples=tuple(samples))

    def _run_row(self, row: RecurrentRow) -> float | None:
        rid, loop, table = row.request_id, row.loop, row.block_table
        req = self.requests[rid]
        self.tables[(rid, loop)] = table
        end = row.start + row.num_tokens
        if loop == 0:
            want = req.prompt_token_ids[row.start : end] if row.start < req.prompt_len else None
            if want is None:
                want = [token_for(rid, row.start - 1)]  # the newest sampled token
            assert row.token_ids == tuple(want)
        else:
            assert row.token_ids is None
        # every key before the row must hold this request's token at version min(loop, exit)
        for q in range(row.start):
            version = min(loop, self.exit_loop[(rid, q)])
            assert self.kv.get(self._slot(table, q)) == (rid, q, version), (rid, loop, q)
        for q in range(row.start, end):
            self.kv[self._slot(table, q)] = (rid, q, loop)
        pos = end - 1
        if row.start >= req.prompt_len:  # a decode token
            exit_loop = self.expected_exit_loop(rid, pos)
            assert loop <= exit_loop
            assert row.sample == (loop == req.controls.max_loops - 1)
            if loop == exit_loop:
                self.exit_loop[(rid, pos)] = exit_loop
                if not row.sample:
                    self.pending_coda[rid] = pos
        else:
            assert row.sample == (loop == DEPTH - 1 and end == req.prompt_len)
            if loop == DEPTH - 1:
                for q in range(row.start, end):
                    self.exit_loop[(rid, q)] = DEPTH - 1
        return self.hazard(rid, loop, pos)

    def step(self) -> list[Request]:
        plan = self.sched.schedule()
        if plan is None:
            return []
        return self.sched.update(plan, self.execute(plan))


def drain(worker: FakeWorker, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not worker.sched.has_unfinished():
            return
        worker.step()
    raise AssertionError("the scheduler did not drain")


def expected_outputs(worker: FakeWorker, req: Request) -> tuple[list[int], list[int]]:
    """Serial semantics: first token from full-depth prefill, then one exit per position."""
    tokens, depths = [], []
    pos = req.prompt_len - 1
    while True:
        tokens.append(token_for(req.request_id, pos))
        depths.append(
            DEPTH if pos < req.prompt_len else worker.expected_exit_loop(req.request_id, pos) + 1
        )
        if tokens[-1] in req.stop_token_ids or len(tokens) >= req.params.max_tokens:
            return tokens, depths
        pos += 1


def assert_clean(sched: Scheduler) -> None:
    assert sched.blocks.num_used == 0
    assert not sched.has_unfinished()
    assert sorted(sched._free_slots) == list(range(sched.config.max_num_seqs))
