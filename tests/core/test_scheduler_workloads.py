"""Scheduler unit tests, pure Python: admission, budgets and slots, abort, the written-prefix
guard, and randomized workloads against serial semantics.

Hand-built StepResults, no torch, no model: `scheduler_helpers.FakeWorker` plays the model.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from scheduler_helpers import (
    DEPTH,
    FakeWorker,
    assert_clean,
    drain,
    expected_outputs,
    make_request,
    make_scheduler,
)

from rlt_engine.core.plan import Stage
from rlt_engine.core.request import Request

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
