"""Scheduler unit tests, pure Python: stage transitions, KV copies and refill versus no-refill.

Hand-built StepResults, no torch, no model: `scheduler_helpers.FakeWorker` plays the model.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from scheduler_helpers import (
    DEPTH,
    FakeWorker,
    assert_clean,
    drain,
    expected_outputs,
    make_request,
    make_scheduler,
    token_for,
)

from rlt_engine.core.plan import CodaRow, KVCopy, Stage
from rlt_engine.core.request import Request

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
