"""Scheduler unit tests, pure Python: hand-built StepResults, no torch, no model.

`FakeWorker` plays the model. It keeps a ledger of which (request, position, loop version) each
KV slot holds, applies the plan's KV copies, and checks that every row only reads slots that
hold the right token at the LAST_EXITED version min(loop, exit loop). Hazards and sampled
tokens are deterministic functions of (request, loop, position).
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Callable

import pytest

from rlt_engine.config import SchedulerConfig
from rlt_engine.core.block_manager import BlockManager
from rlt_engine.core.exit_rule import ExitTracker, LoopControls
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
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        prefill_chunk_size=prefill_chunk_size,
        refill=refill,
    )
    return Scheduler(config, BlockManager(num_blocks, block_size, depth), depth)


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


# -- stage transitions --------------------------------------------------------------------


def test_scheduler_never_imports_torch():
    code = (
        "import sys; import rlt_engine.core.scheduler, rlt_engine.core.request; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_fixed_depth_stage_transitions_and_no_coda_steps():
    sched = make_scheduler()
    worker = FakeWorker(sched, hazard=lambda rid, loop, pos: 0.9)  # ignored at threshold 1.0
    req = worker.track(make_request("a", prompt_len=3, max_tokens=3))
    sched.add(req)
    assert req.stage is Stage.WAITING
    for loop in range(DEPTH):
        plan = sched.schedule()
        assert plan is not None and plan.stage is Stage.RECURRENT
        (row,) = plan.rows
        assert (row.loop, row.start, row.num_tokens) == (loop, 0, 3)
        assert req.stage is Stage.PREFILL
        got = sched.update(plan, worker.execute(plan))
        assert got == ([req] if loop == DEPTH - 1 else [])
    assert req.stage is Stage.PRELUDE and req.exit_depths == [DEPTH]
    assert req.first_token_time is not None
    for _ in range(2):  # each token: D traversals, sampled in the last one, never a CODA step
        for loop in range(DEPTH):
            plan = sched.schedule()
            assert plan.stage is Stage.RECURRENT and plan.rows[0].loop == loop
            sched.update(plan, worker.execute(plan))
    assert req.finished and req.finish_reason == "length"
    assert req.output_token_ids == expected_outputs(worker, req)[0]
    assert req.exit_depths == [DEPTH] * 3
    assert all(p.stage is Stage.RECURRENT for p in worker.plans)
    assert sched.schedule() is None
    assert_clean(sched)


def test_adaptive_exit_gets_a_coda_step_and_kv_copies_into_deeper_planes():
    sched = make_scheduler(block_size=2)
    # token at position 3 exits after loop 2 (hazard 0.6 -> CDF 0.6 < 0.7, then 0.84 >= 0.7)
    worker = FakeWorker(sched, hazard=lambda rid, loop, pos: 0.6)
    req = worker.track(make_request("a", prompt_len=3, max_tokens=2, threshold=0.7))
    sched.add(req)
    for _ in range(DEPTH):  # prefill
        plan = sched.schedule()
        sched.update(plan, worker.execute(plan))
    assert req.stage is Stage.PRELUDE and req.written == [3] * DEPTH
    for loop in range(2):
        plan = sched.schedule()
        (row,) = plan.rows
        assert row.loop == loop and row.start == 3 and not row.sample
        sched.update(plan, worker.execute(plan))
    assert req.stage is Stage.CODA
    tables = req.block_tables
    # the token exited at loop index 1: its K/V must reach planes 2 and 3 before anyone reads
    assert req.written == [4, 4, 4, 4]
    plan = sched.schedule()
    assert plan.stage is Stage.CODA and plan.rows == (CodaRow("a", req.slot),)
    assert plan.kv_copies == (
        KVCopy(tables[1][1] * 2 + 1, (tables[2][1] * 2 + 1, tables[3][1] * 2 + 1)),
    )
    sched.update(plan, worker.execute(plan))
    assert req.finished and req.finish_reason == "length"
    assert req.exit_depths == [DEPTH, 2]
    assert_clean(sched)


@pytest.mark.parametrize(("exit_after", "deeper"), [(1, (1, 2, 3)), (3, (3,)), (4, ())])
def test_kv_copy_targets_exactly_the_planes_deeper_than_the_exit(exit_after, deeper):
    sched = make_scheduler(block_size=3)
    hazard = 1.0 if exit_after < DEPTH else 0.0
    worker = FakeWorker(
        sched, hazard=lambda rid, loop, pos: hazard if loop == exit_after - 1 else 0.0
    )
    req = worker.track(make_request("a", prompt_len=4, max_tokens=3, threshold=0.5))
    sched.add(req)
    drain(worker)
    assert req.exit_depths == [DEPTH, exit_after, exit_after]
    copies = [c for p in worker.plans for c in p.kv_copies]
    if not deeper:
        assert copies == []
        return
    assert len(copies) == 2  # positions 4 and 5 (the last sampled token is never run)
    for copy, pos in zip(copies, (4, 5), strict=True):

        def slot(plane: int, pos: int = pos) -> int:
            table = worker.tables[("a", plane)]
            return table[pos // 3] * 3 + pos % 3

        assert copy.src == slot(exit_after - 1)
        assert copy.dst == tuple(slot(d) for d in deeper)


def test_max_loops_below_depth_exits_in_step_and_copies():
    sched = make_scheduler()
    worker = FakeWorker(sched)
    req = worker.track(make_request("a", prompt_len=2, max_tokens=3, max_loops=2))
    sched.add(req)
    drain(worker)
    assert req.exit_depths == [DEPTH, 2, 2]
    assert all(p.stage is Stage.RECURRENT for p in worker.plans)  # exit known ahead: no CODA
    # position 2's copy rides on the next plan; position 3's is dropped: the request finished
    assert [len(c.dst) for p in worker.plans for c in p.kv_copies] == [2]
    assert_clean(sched)


def test_min_loops_holds_back_an_early_exit():
    sched = make_scheduler()
    worker = FakeWorker(sched, hazard=lambda rid, loop, pos: 0.99)
    req = worker.track(make_request("a", max_tokens=3, min_loops=3, threshold=0.5))
    sched.add(req)
    drain(worker)
    assert req.exit_depths == [DEPTH, 3, 3]


def test_stop_token_finishes_with_stop():
    sched = make_scheduler()
    worker = FakeWorker(sched)
    req = worker.track(make_request("a", prompt_len=3, max_tokens=10))
    req.stop_token_ids = frozenset({token_for("a", 4)})  # the third token
    sched.add(req)
    drain(worker)
    assert req.finish_reason == "stop" and len(req.output_token_ids) == 3
    assert_clean(sched)


# -- refill versus no-refill ----------------------------------------------------------------


def _two_request_trace(refill: bool) -> tuple[FakeWorker, Request, Request]:
    sched = make_scheduler(refill=refill)

    def hazard(rid: str, loop: int, pos: int) -> float:
        return 1.0 if rid == "early" else 0.0

    worker = FakeWorker(sched, hazard)
    early = worker.track(make_request("early", prompt_len=2, max_tokens=4, threshold=0.5))
    late = worker.track(make_request("late", prompt_len=2, max_tokens=4, threshold=0.5))
    sched.add(early)
    sched.add(late)
    drain(worker)
    return worker, early, late


def test_refill_mixes_depths_in_one_traversal():
    worker, early, late = _two_request_trace(refill=True)
    assert early.exit_depths == [DEPTH, 1, 1, 1] and late.exit_depths == [DEPTH] * 4
    mixed = [
        p for p in worker.plans if p.stage is Stage.RECURRENT and len({r.loop for r in p.rows}) > 1
    ]
    assert mixed, "refill must let the early exiter rejoin while the other is mid-loop"
    # the early exiter never waits: every CODA step holds it right after its exit
    assert early.output_token_ids == expected_outputs(worker, early)[0]
    assert late.output_token_ids == expected_outputs(worker, late)[0]
    assert_clean(worker.sched)


def test_no_refill_cohort_waits_for_its_slowest_token():
    worker, early, late = _two_request_trace(refill=False)
    assert early.exit_depths == [DEPTH, 1, 1, 1] and late.exit_depths == [DEPTH] * 4
    for plan in worker.plans:
        if plan.stage is Stage.RECURRENT:
            assert len({r.loop for r in plan.rows}) == 1, plan
    # the early token's CODA is deferred until the late one exits: both then sample together
    codas = [p for p in worker.plans if p.stage is Stage.CODA]
    assert codas and all(p.rows == (CodaRow("early", p.rows[0].slot),) for p in codas)
    for i, plan in enumerate(worker.plans):
        if plan.stage is Stage.CODA:
            prev = worker.plans[i - 1]
            assert prev.stage is Stage.RECURRENT and [r.loop for r in prev.rows] == [DEPTH - 1]
    assert_clean(worker.sched)


def test_no_refill_max_loops_exit_also_waits_for_the_cohort():
    sched = make_scheduler(refill=False)
    worker = FakeWorker(sched)
    short = worker.track(make_request("short", prompt_len=2, max_tokens=3, max_loops=2))
    full = worker.track(make_request("full", prompt_len=2, max_tokens=3))
    sched.add(short)
    sched.add(full)
    drain(worker)
    for plan in worker.plans:
        if plan.stage is Stage.RECURRENT:
            assert len({r.loop for r in plan.rows}) == 1, [
                (r.request_id, r.loop) for r in plan.rows
            ]


# -- admission, budget, slots ---------------------------------------------------------------


def test_fcfs_admission_never_overtakes_the_head():
    # depth 4, block 2: 4 positions -> 2 blocks per plane -> 8 blocks; the pool has 10
    sched = make_scheduler(num_blocks=10, block_size=2)
    worker = FakeWorker(sched)
    big = worker.track(make_request("big", prompt_len=3, max_tokens=2))  # 4 positions: 8 blocks
    head = worker.track(make_request("head", prompt_len=3, max_tokens=2))  # 8 blocks
    small = worker.track(make_request("small", prompt_len=1, max_tokens=1))  # 1 pos: 4 blocks
    for r in (big, head, small):
        sched.add(r)
    worker.step()
    assert big.stage is Stage.PREFILL
    assert head.stage is Stage.WAITING and small.stage is Stage.WAITING  # small fits, but waits
    assert sched.blocks.num_free == 2
    while not big.finished:
        worker.step()
        if not big.finished:
            assert small.stage is Stage.WAITING
    worker.step()
    assert head.stage is not Stage.WAITING
    drain(worker)
    assert_clean(sched)


def test_max_num_seqs_bounds_running_requests_and_slots_are_recycled():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=8)
    worker = FakeWorker(sched)
    reqs = [worker.track(make_request(f"r{i}", prompt_len=1 + i, max_tokens=2)) for i in range(5)]
    for r in reqs:
        sched.add(r)
    seen_slots = set()
    while sched.has_unfinished():
        worker.step()
        assert len(sched.running) <= 2
        seen_slots |= {r.slot for r in sched.running}
    assert seen_slots <= {0, 1}
    for r in reqs:
        assert r.output_token_ids == expected_outputs(worker, r)[0]
    inits = [i.slot for p in worker.plans for i in p.slot_inits]
    frees = [s for p in worker.plans for s in p.slot_frees]
    assert len(inits) == 5 and len(frees) >= 3  # a free rides on the next plan, if any
    assert_clean(sched)


def test_prefill_chunks_respect_budget_and_decode_rides_every_traversal():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=5, prefill_chunk_size=3)
    worker = FakeWorker(sched)
    decoder = worker.track(make_request("dec", prompt_len=1, max_tokens=12))
    long = worker.track(make_request("long", prompt_len=17, max_tokens=1))
    sched.add(decoder)
    for _ in range(DEPTH):  # prefill the decoder alone
        worker.step()
    sched.add(long)
    chunk_sizes = []
    while long.stage is not Stage.FINISHED:
        worker.step()
        plan = worker.plans[-1]
        rows = {r.request_id: r for r in plan.rows}
        assert "dec" in rows, "a prefilling neighbour must never stall decode"
        if "long" in rows:
            assert rows["long"].num_tokens <= 3
            if rows["long"].loop == 0:
                chunk_sizes.append(rows["long"].num_tokens)
    assert sum(chunk_sizes) == 17 and max(chunk_sizes) == 3
    drain(worker)
    assert decoder.output_token_ids == expected_outputs(worker, decoder)[0]
    assert_clean(sched)


def test_chunk_in_flight_waits_for_room_for_all_its_rows():
    # budget 3: "b" starts a 2-token chunk beside one decode row; when a second decoder
    # appears, the chunk (mid-loop) cannot shrink and must wait without reading unwritten KV
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=3, prefill_chunk_size=2)
    worker = FakeWorker(sched)
    a = worker.track(make_request("a", prompt_len=1, max_tokens=6))
    c = worker.track(make_request("c", prompt_len=1, max_tokens=6))
    b = worker.track(make_request("b", prompt_len=6, max_tokens=2))
    for r in (a, c, b):
        sched.add(r)
    drain(worker)
    for r in (a, b, c):
        assert r.output_token_ids == expected_outputs(worker, r)[0]
    assert_clean(sched)


def test_request_that_can_never_fit_is_rejected():
    sched = make_scheduler(num_blocks=8, block_size=2)
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(make_request("huge", prompt_len=4, max_tokens=2))  # 5 pos: 3 x 4 = 12 > 8
    assert not sched.has_unfinished()
    sched.add(make_request("ok", prompt_len=3, max_tokens=2))  # 4 positions: 8 blocks
    assert sched.has_unfinished()


# -- abort ----------------------------------------------------------------------------------


def _advance_to(worker: FakeWorker, req: Request, cond: Callable[[Request], bool]) -> None:
    for _ in range(200):
        if cond(req):
            return
        worker.step()
    raise AssertionError("stage never reached")


@pytest.mark.parametrize(
    "stage",
    ["waiting", "prefill", "recurrent", "coda", "finished"],
)
def test_abort_at_every_stage_frees_everything(stage):
    sched = make_scheduler(max_num_seqs=1, prefill_chunk_size=2)
    worker = FakeWorker(sched, hazard=lambda rid, loop, pos: 0.6)
    blocker = worker.track(make_request("blocker", prompt_len=2, max_tokens=2))
    req = worker.track(make_request("x", prompt_len=5, max_tokens=4, threshold=0.7))
    sched.add(blocker)
    sched.add(req)
    conditions = {
        "waiting": lambda r: r.stage is Stage.WAITING and blocker.stage is not Stage.WAITING,
        "prefill": lambda r: r.stage is Stage.PREFILL and r.num_prefilled > 0 and r.loop > 0,
        "recurrent": lambda r: r.stage is Stage.RECURRENT and r.loop > 0,
        "coda": lambda r: r.stage is Stage.CODA,
        "finished": lambda r: r.finished,
    }
    _advance_to(worker, req, conditions[stage])
    assert (sched.abort("x") is req) == (stage != "finished")
    assert req.finished
    assert req.finish_reason == ("length" if stage == "finished" else "abort")
    assert req.block_tables is None and req.pending_copies == []
    assert sched.abort("x") is None
    drain(worker)
    assert blocker.output_token_ids == expected_outputs(worker, blocker)[0]
    assert_clean(sched)


def test_abort_while_a_step_is_in_flight_drops_its_stale_result():
    sched = make_scheduler()
    worker = FakeWorker(sched)
    a = worker.track(make_request("a", prompt_len=2, max_tokens=3))
    b = worker.track(make_request("b", prompt_len=3, max_tokens=3))
    sched.add(a)
    sched.add(b)
    for _ in range(DEPTH - 1):
        worker.step()
    plan = sched.schedule()
    result = worker.execute(plan)  # samples both first tokens
    sched.abort("a")
    got = sched.update(plan, result)
    assert got == [b] and a.output_token_ids == [] and a.finish_reason == "abort"
    drain(worker)
    assert b.output_token_ids == expected_outputs(worker, b)[0]
    assert_clean(sched)


# -- written-prefix guard -------------------------------------------------------------------


def test_written_prefix_guard_refuses_rows_that_would_read_unwritten_kv():
    sched = make_scheduler()
    worker = FakeWorker(sched)
    req = worker.track(make_request("a", prompt_len=3, max_tokens=3))
    sched.add(req)
    for _ in range(DEPTH + 2):  # prefill, then loops 0 and 1 of the second token
        worker.step()
    assert req.stage is Stage.RECURRENT and req.loop == 2
    assert req.written == [4, 4, 3, 3]
    req.written[2] = 2  # pretend position 2 of plane 2 was never written
    with pytest.raises(RuntimeError, match="unwritten"):
        sched.schedule()


# -- randomized: many requests, random hazards, arrivals and aborts -------------------------


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_match_serial_semantics(seed):
    rng = random.Random(seed)
    refill = seed % 2 == 0
    block_size = rng.choice([1, 2, 3, 16])
    max_num_seqs = rng.randint(1, 4)
    sched = make_scheduler(
        block_size=block_size,
        num_blocks=rng.randint(60, 120) // block_size + 8,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=rng.randint(max_num_seqs, 12),
        prefill_chunk_size=rng.randint(1, 8),
        refill=refill,
    )
    salt = rng.random()

    def hazard(rid: str, loop: int, pos: int) -> float:
        return random.Random(f"{salt}/{rid}/{loop}/{pos}").random() ** 2

    worker = FakeWorker(sched, hazard)
    pending = []
    for i in range(rng.randint(3, 9)):
        max_loops = rng.randint(1, DEPTH)
        req = make_request(
            f"r{i}",
            prompt_len=rng.randint(1, 10),
            max_tokens=rng.randint(1, 6),
            min_loops=rng.randint(1, max_loops),
            max_loops=max_loops,
            threshold=rng.choice([0.0, 0.3, 0.6, 0.9, 1.0]),
        )
        arrive = rng.randint(0, 30)
        abort = rng.randint(0, 60) if rng.random() < 0.3 else None
        pending.append((arrive, abort, req))
    aborted = set()
    step = 0
    while step < 5000:
        for arrive, abort, req in pending:
            if arrive == step:
                try:
                    sched.add(worker.track(req))
                except ValueError:
                    aborted.add(req.request_id)  # can never fit this pool
            if abort == step and sched.abort(req.request_id) is not None:
                aborted.add(req.request_id)
        if step > 60 and not sched.has_unfinished():
            break
        worker.step()
        step += 1
    assert_clean(sched)
    for _, _, req in pending:
        if req.request_id not in aborted:
            assert req.finish_reason in ("length", "stop")
            assert (req.output_token_ids, req.exit_depths) == expected_outputs(worker, req)
