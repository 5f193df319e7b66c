"""Scheduler unit tests, pure Python: admission, budgets and slots, window reservation and
block appends, aborts, failed steps, and randomized workloads against serial semantics.

No torch, no model: `scheduler_helpers.FakeWorker` plays the device and checks every read.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from scheduler_helpers import (
    DEPTH,
    FakeWorker,
    assert_clean,
    check_outputs,
    expected_outputs,
    make_request,
    make_scheduler,
    token_for,
)

from rlt_engine.core.plan import Stage
from rlt_engine.core.request import Request
from rlt_engine.core.scheduler import Scheduler

# -- admission, budget, slots ---------------------------------------------------------------


def test_fcfs_admission_never_overtakes_the_head():
    # depth 4, block 2: 4 positions -> 2 blocks per plane -> 8 blocks; the pool has 10
    sched = make_scheduler(num_blocks=10, block_size=2)
    worker = FakeWorker(sched)
    big = worker.add(make_request("big", 3, 2))  # 4 positions: 8 blocks
    head = worker.add(make_request("head", 3, 2))  # 8 blocks
    small = worker.add(make_request("small", 1, 1))  # 1 position: 4 blocks
    worker.step()
    assert big.stage is Stage.DECODE
    assert head.stage is Stage.WAITING and small.stage is Stage.WAITING  # small fits, but waits
    assert sched.blocks.num_free == 2
    while not big.finished:
        worker.step()
        if not big.finished:
            assert small.stage is Stage.WAITING
    worker.step()
    assert head.stage is not Stage.WAITING
    worker.drain()
    check_outputs(worker, [big, head, small])
    assert_clean(worker)


def test_max_num_seqs_bounds_running_requests_and_slots_are_recycled():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=8, decode_window=2)
    worker = FakeWorker(sched)
    reqs = [worker.add(make_request(f"r{i}", 1 + i, 2)) for i in range(5)]
    seen_slots = set()
    while sched.has_unfinished():
        worker.step()
        assert len(sched.running) <= 2
        seen_slots |= {r.slot for r in sched.running}
    worker.flush()
    assert seen_slots <= {0, 1}
    check_outputs(worker, reqs)
    inits = [i.slot for p in worker.plans for i in p.slot_inits]
    frees = [s for p in worker.plans for s in p.slot_frees]
    assert len(inits) == 5 and sorted(frees) == sorted(inits)  # every slot freed, once
    assert_clean(worker)


def test_prefill_chunks_respect_budget_and_decode_rides_every_step():
    sched = make_scheduler(
        max_num_seqs=2, max_num_batched_tokens=5, prefill_chunk_size=3, decode_window=2
    )
    worker = FakeWorker(sched)
    decoder = worker.add(make_request("dec", 1, 30))
    worker.step()  # prefill the decoder alone
    long = worker.add(make_request("long", 17, 1))
    chunk_sizes = []
    while not long.finished:
        worker.step()
        plan = worker.plans[-1]
        assert plan.decode_traversals == 2, "a prefilling neighbour must never stall decode"
        for rows in worker.rows_of(-1):
            assert [r.rid for r in rows] == ["dec"]
        for wave in plan.prefill:
            chunk_sizes += [len(c.token_ids) for c in wave if c.request_id == "long"]
    assert sum(chunk_sizes) == 17 and max(chunk_sizes) == 3 and len(chunk_sizes) == 6
    worker.drain()
    check_outputs(worker, [decoder, long])
    assert_clean(worker)


def test_a_tight_budget_shares_prefill_between_requests_beside_decode():
    # budget 3: "b" prefills 2 tokens per step beside two decoding requests
    sched = make_scheduler(
        max_num_seqs=3, max_num_batched_tokens=3, prefill_chunk_size=2, decode_window=2
    )
    worker = FakeWorker(sched, hazard=lambda rid, loop, pos: 0.5)
    a = worker.add(make_request("a", 1, 6, threshold=0.7))
    c = worker.add(make_request("c", 1, 6, threshold=0.7))
    b = worker.add(make_request("b", 6, 2))
    worker.drain()
    assert all(p.num_prefill_tokens <= 3 for p in worker.plans)
    check_outputs(worker, [a, b, c])
    assert_clean(worker)


def test_request_that_can_never_fit_is_rejected():
    sched = make_scheduler(num_blocks=8, block_size=2)
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(make_request("huge", 4, 2))  # 5 positions: 3 x 4 = 12 > 8
    assert not sched.has_unfinished()
    sched.add(make_request("ok", 3, 2))  # 4 positions: 8 blocks
    assert sched.has_unfinished()


# -- window reservation and block appends ---------------------------------------------------


def _reach(req: Request, window: int, last_chunk: bool) -> int:
    """KV positions a window may touch (what must be reserved before it runs)."""
    if req.stage is Stage.DECODE:
        return min(req.decode_position + window, req.max_positions)
    return min(req.prompt_len + window, req.max_positions) if last_chunk else req.prompt_len


@pytest.mark.parametrize("window", [1, 2, 5])
@pytest.mark.parametrize("kv_layout", ["last_exited", "shared"])
def test_windows_are_reserved_exactly_and_new_blocks_are_sent_once(window, kv_layout):
    sched = make_scheduler(
        block_size=2, incremental_kv=True, decode_window=window, kv_layout=kv_layout
    )
    worker = FakeWorker(sched, hazard=lambda rid, loop, pos: 0.7 if pos % 3 else 0.0)
    reqs = [
        worker.add(make_request(f"r{i}", 1 + 2 * i, 9 + i, threshold=0.5, max_loops=1 + i))
        for i in range(4)
    ]
    sent: dict[int, list[list[int]]] = {}  # slot -> tables as told to the worker
    while sched.has_unfinished():
        plan = sched.schedule()
        last = {c.slot for wave in plan.prefill for c in wave if c.last}
        for init in plan.slot_inits:
            sent[init.slot] = [list(t) for t in init.block_tables]
        for append in plan.block_appends:
            for table, new in zip(sent[append.slot], append.blocks, strict=True):
                assert not set(new) & set(table), "a block sent twice"
                table.extend(new)
        for req in sched.running:
            # every decoding request (and every one whose prompt ends now) has exactly the
            # blocks its window may reach: no fewer (the fake checks too), no more
            need = -(-_reach(req, plan.decode_traversals, req.slot in last) // 2)
            assert len(req.block_tables[0]) == need, req.request_id
            assert sent[req.slot] == req.block_tables
        sched.update(plan, worker.execute(plan))
    worker.flush()
    assert any(p.block_appends for p in worker.plans)
    check_outputs(worker, reqs)
    assert_clean(worker)


def test_the_fake_catches_a_window_the_scheduler_did_not_reserve(monkeypatch):
    sched = make_scheduler(block_size=2, incremental_kv=True, decode_window=3)
    worker = FakeWorker(sched, check_reservation=False)  # let the window run into the hole
    worker.add(make_request("a", 2, 8, max_loops=1))  # a token per traversal
    short = staticmethod(
        lambda req, window, position=None: min(
            (req.decode_position if position is None else position) + window - 1, req.max_positions
        )
    )
    monkeypatch.setattr(Scheduler, "_window_end", short)
    with pytest.raises(AssertionError, match="past the table end"):
        worker.drain()


def test_the_fake_catches_a_missing_block_append(monkeypatch):
    sched = make_scheduler(block_size=2, incremental_kv=True, decode_window=2)
    worker = FakeWorker(sched)
    worker.add(make_request("a", 2, 8))
    monkeypatch.setattr(Scheduler, "_block_appends", lambda self: ())
    with pytest.raises(AssertionError, match="mirror != tables"):
        worker.drain()


def test_the_fake_refuses_a_window_longer_than_the_device_buffers():
    sched = make_scheduler(decode_window=3)
    worker = FakeWorker(sched)
    worker.window = 2
    worker.add(make_request("a", 2, 4))
    with pytest.raises(AssertionError, match="longer than the device"):
        worker.step()


# -- abort ----------------------------------------------------------------------------------


def _advance_to(worker: FakeWorker, req: Request, cond: Callable[[Request], bool]) -> None:
    for _ in range(200):
        if cond(req):
            return
        worker.step()
    raise AssertionError("stage never reached")


@pytest.mark.parametrize("stage", ["waiting", "prefill", "decode", "between_tokens", "finished"])
def test_abort_at_every_stage_frees_everything(stage):
    sched = make_scheduler(max_num_seqs=1, prefill_chunk_size=2, incremental_kv=True)
    worker = FakeWorker(sched, hazard=lambda rid, loop, pos: 0.6)
    blocker = worker.add(make_request("blocker", 2, 2))
    req = worker.add(make_request("x", 5, 4, threshold=0.7))

    def device_loop(r: Request) -> int | None:
        s = worker.slots.get(r.slot) if r.slot is not None else None
        return None if s is None or not s.active else s.loop

    conditions = {
        "waiting": lambda r: r.stage is Stage.WAITING and blocker.stage is not Stage.WAITING,
        "prefill": lambda r: r.stage is Stage.PREFILL and r.num_prefilled > 0,
        "decode": lambda r: r.stage is Stage.DECODE and (device_loop(r) or 0) > 0,
        "between_tokens": lambda r: (
            r.stage is Stage.DECODE and len(r.output_token_ids) == 2 and device_loop(r) == 0
        ),
        "finished": lambda r: r.finished,
    }
    _advance_to(worker, req, conditions[stage])
    slot = req.slot
    assert (sched.abort("x") is req) == (stage != "finished")
    assert req.finished
    assert req.finish_reason == ("length" if stage == "finished" else "abort")
    assert req.block_tables is None and req.slot is None and req.snapshot is None
    assert sched.blocks.owned_blocks("x") == []
    assert sched.abort("x") is None
    worker.step()
    if slot is not None and stage != "finished":
        assert slot in worker.plans[-1].slot_frees  # the device forgets it before it runs
    worker.drain()
    check_outputs(worker, [blocker])
    assert_clean(worker)


def test_abort_while_a_step_is_in_flight_drops_its_stale_result():
    sched = make_scheduler(decode_window=2)
    worker = FakeWorker(sched)
    a = worker.add(make_request("a", 2, 3))
    b = worker.add(make_request("b", 3, 3))
    plan = sched.schedule()
    result = worker.execute(plan)  # both first tokens, then a window
    assert {e.slot for e in result.events} == {a.slot, b.slot}
    sched.abort("a")
    got = sched.update(plan, result)
    assert got == [b] and a.output_token_ids == [] and a.finish_reason == "abort"
    worker.drain()
    check_outputs(worker, [b])
    assert_clean(worker)


def test_abort_mid_window_drops_the_rest_of_its_events():
    sched = make_scheduler(decode_window=4)
    worker = FakeWorker(sched, hazard=lambda rid, loop, pos: 1.0)  # a token per traversal
    a = worker.add(make_request("a", 2, 20, threshold=0.5))
    b = worker.add(make_request("b", 2, 20, threshold=0.5))
    worker.step()
    plan = sched.schedule()
    result = worker.execute(plan)
    sched.abort("b")
    assert sched.update(plan, result) == [a]
    assert len(a.output_token_ids) == 9 and len(b.output_token_ids) == 5
    worker.drain()
    check_outputs(worker, [a])
    assert_clean(worker)


# -- a failed step --------------------------------------------------------------------------


def test_fail_plan_aborts_exactly_the_requests_the_plan_touched():
    # max_num_seqs 3, budget 4: "dec" decodes, "p1" gets a chunk, "p2" is admitted (slot init)
    # without a chunk (no budget left), "w" waits for a slot; the plan fails
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=4, prefill_chunk_size=4)
    worker = FakeWorker(sched)
    dec = worker.add(make_request("dec", 2, 6))
    worker.step()
    p1 = worker.add(make_request("p1", 4, 3))
    p2 = worker.add(make_request("p2", 4, 3))
    w = worker.add(make_request("w", 2, 3))
    plan = sched.schedule()
    assert [c.request_id for wave in plan.prefill for c in wave] == ["p1"]
    assert {i.slot for i in plan.slot_inits} == {p1.slot, p2.slot}
    worker.execute(plan)  # the device applied it, then the step failed: events lost
    failed = sched.fail_plan()
    assert set(failed) == {dec, p1, p2}  # every device state the plan changed; not "w"
    assert all(r.finish_reason == "abort" for r in failed)
    assert sched.fail_plan() == []
    worker.drain()
    check_outputs(worker, [w])
    assert_clean(worker)


def test_fail_plan_spares_a_request_requeued_before_its_slot_was_initialised():
    # growth of "grow" preempts "late", admitted by this very plan: "late" goes back to the
    # queue with nothing on the device, so a failure of the plan does not concern it
    sched = make_scheduler(
        num_blocks=4 * 4,
        block_size=2,
        incremental_kv=True,
        enable_preemption=True,
        max_num_seqs=2,
        decode_window=2,
    )
    worker = FakeWorker(sched)
    grow = worker.add(make_request("grow", 2, 7, max_loops=1))  # a token per traversal
    worker.step()
    late = worker.add(make_request("late", 3, 2))  # takes the 8 free blocks
    plan = sched.schedule()  # "grow" needs 4 more for its window: "late" is the worst
    assert late.stage is Stage.WAITING and not plan.slot_inits and not plan.swap_outs
    worker.execute(plan)
    assert sched.fail_plan() == [grow]
    worker.drain()
    check_outputs(worker, [late])
    assert_clean(worker)


# -- randomized: many requests, random hazards, arrivals and aborts -------------------------


@pytest.mark.parametrize("lookahead", [1, 2])
@pytest.mark.parametrize("seed", range(60))
def test_random_workloads_match_serial_semantics(seed, lookahead):
    """Synchronous and planning a window ahead (lookahead 2: a slot certain to be free is
    handed to a queued request before its owner's last results are seen), under every memory
    and queue policy: SHARED, prefix caching (prompts sharing a prefix), incremental KV,
    priority with preemption."""
    rng = random.Random(seed)
    refill = seed % 2 == 0
    window = (1, 2, 5)[seed % 3]
    block_size = rng.choice([1, 2, 3, 16])
    max_num_seqs = rng.randint(1, 4)
    layout = rng.choice(["last_exited", "shared"])
    prefix = layout == "last_exited" and rng.random() < 0.5
    sched = make_scheduler(
        block_size=block_size,
        num_blocks=rng.randint(60, 160) // block_size + 8,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=rng.randint(max_num_seqs, 12),
        prefill_chunk_size=rng.randint(1, 8),
        refill=refill,
        incremental_kv=rng.random() < 0.5,
        decode_window=window,
        lookahead=lookahead,
        kv_layout=layout,
        enable_prefix_caching=prefix,
        scheduling_policy=rng.choice(["fcfs", "priority"]),
        enable_preemption=rng.random() < 0.5,
    )
    salt = rng.random()

    def hazard(rid: str, loop: int, pos: int) -> float:
        return random.Random(f"{salt}/{rid}/{loop}/{pos}").random() ** 2

    worker = FakeWorker(sched, hazard)
    pending = []
    for i in range(rng.randint(3, 10)):
        max_loops = rng.randint(1, DEPTH)
        prompt_len = rng.randint(1, 10)
        prompt: int | list[int] = prompt_len
        if prefix and rng.random() < 0.5:  # a shared prefix the cache can reuse
            prompt = [*[7, 8, 9, 10, 11, 12][: prompt_len // 2 + 1], 20 + i]
            prompt_len = len(prompt)
        stop = (token_for(f"r{i}", prompt_len + rng.randint(0, 4)),) if rng.random() < 0.2 else ()
        req = make_request(
            f"r{i}",
            prompt,
            max_tokens=rng.randint(1, 6),
            priority=rng.randint(0, 3),
            min_loops=rng.randint(1, max_loops),
            max_loops=max_loops,
            threshold=rng.choice([0.0, 0.3, 0.6, 0.9, 1.0]),
            stop=stop,
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
    worker.flush()
    assert_clean(worker)
    for _, _, req in pending:
        if req.request_id not in aborted:
            assert req.finish_reason in ("length", "stop")
            assert (req.output_token_ids, req.exit_depths) == expected_outputs(worker, req)
