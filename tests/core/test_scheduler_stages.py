"""Scheduler unit tests, pure Python: stage transitions, decode windows, token events, exit
copies, refill versus no-refill.

No torch, no model: `scheduler_helpers.FakeWorker` plays the device (slot batch, prefill
chunks, decode windows with the real exit rule) and checks every KV read.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

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

from rlt_engine.core.plan import MaskUpdate, Sample, Stage, StepResult, TokenEvent
from rlt_engine.core.request import Request
from rlt_engine.sampling_params import StructuredOutput

# -- stage transitions --------------------------------------------------------------------


def test_scheduler_never_imports_torch():
    code = (
        "import sys; import rlt_engine.core.scheduler, rlt_engine.core.request; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("window", [1, 2, 5])
def test_fixed_depth_stage_transitions_and_one_token_per_depth_traversals(window):
    sched = make_scheduler(decode_window=window)
    worker = FakeWorker(sched, hazard=lambda rid, loop, pos: 0.9)  # ignored at threshold 1.0
    req = worker.track(make_request("a", 3, 3))
    sched.add(req)
    assert req.stage is Stage.WAITING
    plan = sched.schedule()
    assert req.stage is Stage.PREFILL
    ((chunk,),) = plan.prefill  # the whole prompt through every loop, in one step
    assert (chunk.request_id, chunk.start, chunk.last) == ("a", 0, True)
    assert chunk.token_ids == (10, 11, 12)
    assert plan.decode_traversals == window  # the first token decodes in this very step
    result = worker.execute(plan)
    assert result.events[0] == TokenEvent(req.slot, Sample(token_for("a", 2)), DEPTH)
    assert sched.update(plan, result) == [req]
    assert req.stage is Stage.DECODE and req.first_token_time is not None
    worker.drain()
    assert req.finished and req.finish_reason == "length"
    assert (req.output_token_ids, req.exit_depths) == expected_outputs(worker, req)
    assert req.exit_depths == [DEPTH] * 3
    # two decode tokens of DEPTH traversals each, `window` traversals per step; the last
    # window cut to what the request may still need (less than a token's loops idle)
    work, idle = worker.plans[:-1], worker.plans[-1]
    assert len(work) == math.ceil(2 * DEPTH / window)
    windows = [p.decode_traversals for p in work]
    assert all(t == window for t in windows[:-1]) and 0 < windows[-1] <= window
    assert 2 * DEPTH <= sum(windows) < 3 * DEPTH
    assert all(not p.prefill for p in work[1:])
    assert not idle.has_work and idle.slot_frees == (0,)  # the idle flush frees the slot
    # the traversal that finishes a token samples it: no step without a loop
    assert sum(len(r.events) for r in worker.results) == 3
    assert sched.schedule() is None
    assert_clean(worker)


def test_a_token_arrives_in_the_step_of_the_traversal_it_exits_in():
    sched = make_scheduler(decode_window=1)
    worker = FakeWorker(sched)
    req = worker.track(make_request("a", 2, 3))
    sched.add(req)
    worker.drain()
    # plan 0: prefill (+ loop 0 of position 2); loops 1..3 in plans 1..3; then position 3
    got = [[e.exit_depth for e in r.events] for r in worker.results]
    assert got == [[DEPTH], [], [], [DEPTH], [], [], [], [DEPTH], []]  # + the idle flush
    rows = [[(r.rid, r.loop, r.position) for r in t] for t in worker.traversals]
    assert rows == [[("a", loop, pos)] for pos in (2, 3) for loop in range(DEPTH)]
    assert_clean(worker)


def _plane_versions(worker: FakeWorker, req: Request, pos: int) -> list[tuple | None]:
    tables, bs = worker.tables_seen[req.request_id], worker.bs
    return [worker.kv.get(t[pos // bs] * bs + pos % bs) for t in tables]


def test_adaptive_exit_copies_its_kv_into_the_deeper_planes():
    sched = make_scheduler(block_size=2)
    # every decode token exits after loop 2 (hazard 0.6 -> CDF 0.6 < 0.7, then 0.84 >= 0.7)
    worker = FakeWorker(sched, hazard=lambda rid, loop, pos: 0.6)
    req = worker.track(make_request("a", 3, 3, threshold=0.7))
    sched.add(req)
    worker.drain()
    assert req.exit_depths == [DEPTH, 2, 2] and req.finish_reason == "length"
    for pos in (3, 4):  # the last sampled token (position 5) is never run
        assert _plane_versions(worker, req, pos) == [("a", pos, min(d, 1)) for d in range(DEPTH)]
    assert_clean(worker)


@pytest.mark.parametrize("exit_after", [1, 3, 4])
def test_exit_copies_target_exactly_the_planes_deeper_than_the_exit(exit_after):
    sched = make_scheduler(block_size=3)
    hazard = 1.0 if exit_after < DEPTH else 0.0
    worker = FakeWorker(
        sched, hazard=lambda rid, loop, pos: hazard if loop == exit_after - 1 else 0.0
    )
    req = worker.track(make_request("a", 4, 3, threshold=0.5))
    sched.add(req)
    worker.drain()
    assert req.exit_depths == [DEPTH, exit_after, exit_after]
    e = exit_after - 1
    for pos in (4, 5):
        # planes 0..e hold their own loop's version, the deeper ones the copy of version e
        assert _plane_versions(worker, req, pos) == [("a", pos, min(d, e)) for d in range(DEPTH)]
    assert_clean(worker)


def test_a_deeper_token_reads_an_early_exit_through_its_copies():
    # position 3 exits after loop 0; positions 4.. run all loops and read it on planes 1..3
    sched = make_scheduler()
    worker = FakeWorker(sched, hazard=lambda rid, loop, pos: 1.0 if pos == 3 else 0.0)
    req = worker.track(make_request("a", 3, 4, threshold=0.5))
    sched.add(req)
    worker.drain()  # the ledger checks every read
    assert req.exit_depths == [DEPTH, 1, DEPTH, DEPTH]
    assert_clean(worker)


def test_the_ledger_catches_missing_exit_copies():
    sched = make_scheduler()
    worker = FakeWorker(sched, hazard=lambda rid, loop, pos: 1.0 if pos == 3 else 0.0)
    worker.exit_copies = False  # a device that forgets them
    worker.add(make_request("a", 3, 4, threshold=0.5))
    with pytest.raises(AssertionError, match="at loop 1, position 4 reads position 3"):
        worker.drain()


def test_max_loops_below_depth_exits_early_in_the_traversal():
    sched = make_scheduler()
    worker = FakeWorker(sched)
    req = worker.track(make_request("a", 2, 3, max_loops=2))
    sched.add(req)
    worker.drain()
    assert req.exit_depths == [DEPTH, 2, 2]
    assert [(r.loop, r.position) for t in worker.traversals for r in t] == [
        (0, 2),
        (1, 2),
        (0, 3),
        (1, 3),
    ]
    assert_clean(worker)


def test_min_loops_holds_back_an_early_exit():
    sched = make_scheduler()
    worker = FakeWorker(sched, hazard=lambda rid, loop, pos: 0.99)
    req = worker.track(make_request("a", max_tokens=3, min_loops=3, threshold=0.5))
    sched.add(req)
    worker.drain()
    assert req.exit_depths == [DEPTH, 3, 3]
    assert_clean(worker)


@pytest.mark.parametrize("window", [1, 5])
def test_stop_token_finishes_with_stop_and_the_slot_stops_itself(window):
    sched = make_scheduler(decode_window=window)
    # one token per traversal: a window of 5 would emit 5, the device stops at the stop id
    worker = FakeWorker(sched, hazard=lambda rid, loop, pos: 1.0)
    req = worker.track(make_request("a", 3, 10, threshold=0.5, stop=(token_for("a", 4),)))
    sched.add(req)
    worker.drain()
    assert req.finish_reason == "stop" and len(req.output_token_ids) == 3
    assert sum(len(r.events) for r in worker.results) == 3  # nothing after the stop id
    check_outputs(worker, [req])
    assert_clean(worker)


def test_a_first_token_that_finishes_never_decodes():
    sched = make_scheduler(decode_window=5)
    worker = FakeWorker(sched)
    stop = worker.track(make_request("s", 3, 10, stop=(token_for("s", 2),)))
    one = worker.track(make_request("one", 2, 1))
    sched.add(stop)
    sched.add(one)
    worker.drain()
    assert (stop.finish_reason, one.finish_reason) == ("stop", "length")
    assert stop.output_token_ids == [token_for("s", 2)] and len(one.output_token_ids) == 1
    assert worker.traversals == [[]] * len(worker.traversals)  # no row ever decoded
    assert_clean(worker)


# -- decode windows and token events ------------------------------------------------------


@pytest.mark.parametrize("window", [1, 2, 5])
def test_several_tokens_per_window_come_back_in_traversal_order(window):
    sched = make_scheduler(decode_window=window)
    worker = FakeWorker(sched, hazard=lambda rid, loop, pos: 1.0)  # exit after every loop
    a = worker.track(make_request("a", 2, 12, threshold=0.5))
    b = worker.track(make_request("b", 3, 12, threshold=0.5))
    sched.add(a)
    sched.add(b)
    worker.step()  # both prefilled, then a full window
    first = worker.results[0].events
    assert [e.slot for e in first] == [a.slot, b.slot] * (1 + window)  # first tokens, then
    assert [e.exit_depth for e in first] == [DEPTH, DEPTH] + [1] * 2 * window  # per traversal
    assert len(a.output_token_ids) == 1 + window
    worker.step()
    assert [e.slot for e in worker.results[1].events] == [a.slot, b.slot] * window
    worker.drain()
    check_outputs(worker, [a, b])
    assert_clean(worker)


def test_decode_traversals_is_zero_when_nothing_decodes():
    sched = make_scheduler(prefill_chunk_size=2, decode_window=4)
    worker = FakeWorker(sched)
    req = worker.track(make_request("a", 5, 2))
    sched.add(req)
    for _ in range(2):
        worker.step()
        plan = worker.plans[-1]
        assert plan.prefill and not plan.prefill[-1][-1].last
        assert plan.decode_traversals == 0 and worker.results[-1].events == ()
    worker.step()
    assert worker.plans[2].prefill[0][0].last and worker.plans[2].decode_traversals == 4
    worker.drain()
    assert len(worker.plans) == 4 and not worker.plans[3].has_work  # the idle flush
    check_outputs(worker, [req])
    assert_clean(worker)


def test_a_wave_rides_beside_decode_rows_and_alone_only_when_synchronous():
    """Asynchronous, a lone wave ends its plan at its first tokens (time to first token: no
    rows to share its reads with); a wave arriving while others decode rides their window,
    which then ends at the wave's first tokens (its DEPTH traversals), and the next plan's
    window is whole again. Synchronous, a lone wave rides too, in a whole window (its first
    tokens come back with the window anyway)."""
    sync = make_scheduler(decode_window=8)
    sync.add(make_request("a", 5, 4))
    alone = sync.schedule()
    assert alone is not None and alone.wave_rides and alone.decode_traversals == 8

    sched = make_scheduler(decode_window=8, lookahead=2)
    sched.add(make_request("a", 5, 4))
    first = sched.schedule()
    assert first is not None and not first.wave_rides and first.decode_traversals == 0
    sched.add(make_request("b", 3, 4))  # while a's first token is in flight
    second = sched.schedule()
    assert second is not None and second.wave_rides and second.decode_traversals == DEPTH
    assert [c.request_id for c in second.prefill[0]] == ["b"]
    sched.update(first, StepResult(events=()))  # a's first token is not needed for the check
    third = sched.schedule()
    assert third is not None and not third.prefill and third.decode_traversals == 8


def test_a_wave_past_max_ride_rows_runs_before_the_window():
    """A wave larger than the worker's largest captured wave shape does not ride (it would
    run eagerly inside the window): it runs on its own, the window after it; one at the
    bound still rides."""
    for rows, rides in ((6, False), (5, True)):
        sched = make_scheduler(decode_window=8, max_ride_rows=5)
        sched.add(make_request("a", rows, 4))
        plan = sched.schedule()
        assert plan is not None and plan.wave_rides is rides
        assert [c.request_id for c in plan.prefill[0]] == ["a"]
        assert plan.decode_traversals == 8  # synchronous: the window follows in the plan


def test_no_window_runs_after_every_row_has_ended_asynchronously():
    """Planning one window ahead, the scheduler must not launch a window for rows that surely
    end in the windows in flight (max_tokens reached at max_loops traversals a token at most):
    it returns no plan until their results are in, and the last windows are cut to the
    traversals the rows may still need."""
    sched = make_scheduler(decode_window=8, lookahead=2)
    worker = FakeWorker(sched)
    reqs = [worker.track(make_request(rid, 3, 3)) for rid in "ab"]
    for req in reqs:
        sched.add(req)
    first = sched.schedule()  # the wave; its window follows in the next plan
    assert first is not None and first.decode_traversals == 0
    first_result = worker.execute(first)
    second = sched.schedule()  # two decode tokens each: 2 x DEPTH traversals
    assert second is not None and second.decode_traversals == 2 * DEPTH
    second_result = worker.execute(second)
    sched.update(first, first_result)
    assert sched.schedule() is None  # both end in the window in flight
    sched.update(second, second_result)
    assert all(r.finished and r.finish_reason == "length" for r in reqs)
    for req in reqs:
        assert (req.output_token_ids, req.exit_depths) == expected_outputs(worker, req)
    worker.flush()
    assert_clean(worker)


def test_a_slot_certain_to_be_free_is_handed_on_a_window_early():
    """Planning a window ahead with one slot and a queue: once the running request surely
    reaches max_tokens within the window in flight, the next plan already starts the queued
    one in its slot and blocks (the device runs the plans in order), before the first
    request's last tokens are seen; outputs stay those of serial decoding."""
    sched = make_scheduler(decode_window=8, lookahead=2, max_num_seqs=1)
    worker = FakeWorker(sched)
    a = worker.add(make_request("a", 3, 3))
    b = worker.add(make_request("b", 4, 2))
    seen: list[tuple[str, bool, bool]] = []  # at each of a's tokens: b started, a retiring

    def watch(req: Request) -> bool:
        if req is a:
            seen.append((b.stage.name, a in sched.retiring, a in sched.running))
        return False

    worker.drain(stop_check=watch)
    # a's first token; then its last two come back after b's prefill was already planned in
    # a's slot (a retiring until its last token finishes it)
    assert seen == [
        ("WAITING", False, True),
        ("PREFILL", True, False),
        ("PREFILL", False, False),
    ]
    check_outputs(worker, [a, b])
    assert not sched.retiring
    assert_clean(worker)


def test_nothing_is_handed_on_early_without_a_queue_or_synchronously():
    for lookahead, queued in ((2, False), (1, True)):
        sched = make_scheduler(decode_window=8, lookahead=lookahead, max_num_seqs=1)
        worker = FakeWorker(sched)
        reqs = [worker.add(make_request("a", 3, 3))]
        if queued:
            reqs.append(worker.add(make_request("b", 4, 2)))
        for _ in range(50):
            if not sched.has_unfinished():
                break
            worker.step()
            assert not sched.retiring
        worker.flush()
        check_outputs(worker, reqs)
        assert_clean(worker)


def test_a_window_is_cut_to_what_max_loops_allows():
    """Early exits: a row of max_loops 2 needs at most 2 traversals a token."""
    sched = make_scheduler(decode_window=16)
    worker = FakeWorker(sched)
    req = worker.add(make_request("a", 3, 3, max_loops=2))
    worker.drain()
    windows = [p.decode_traversals for p in worker.plans if p.decode_traversals]
    # the wave rides the window's first DEPTH traversals, then two decode tokens of two
    assert windows == [DEPTH + 2 * 2]
    assert req.exit_depths == [DEPTH, 2, 2] and req.finish_reason == "length"


def test_a_last_chunk_with_a_single_output_token_opens_no_window():
    sched = make_scheduler(decode_window=4)
    worker = FakeWorker(sched)
    req = worker.add(make_request("a", 3, 1))
    worker.drain()
    assert [p.decode_traversals for p in worker.plans] == [0, 0]  # the step, then a free
    check_outputs(worker, [req])
    assert_clean(worker)


def test_stale_events_for_finished_or_foreign_slots_are_ignored():
    sched = make_scheduler(decode_window=2)
    worker = FakeWorker(sched)
    a = worker.add(make_request("a", 2, 1))
    b = worker.add(make_request("b", 2, 8))
    worker.step()
    a_slot = worker.plans[0].slot_inits[0].slot
    assert a.finished and not b.finished and a_slot != b.slot
    plan = sched.schedule()
    result = worker.execute(plan)
    stale = StepResult(
        (
            TokenEvent(a_slot, Sample(1), 1),  # a finished: its old slot is nobody's now
            TokenEvent(7, Sample(2), 1),  # a slot nobody holds
            *result.events,
        )
    )
    before = list(b.output_token_ids)
    assert sched.update(plan, stale) == [b]
    assert a.output_token_ids == [token_for("a", 1)]
    assert b.output_token_ids == before + [e.sample.token_id for e in result.events]
    worker.drain()
    check_outputs(worker, [a, b])
    assert_clean(worker)


def test_stop_check_finishing_mid_window_drops_its_later_events():
    sched = make_scheduler(decode_window=5)
    worker = FakeWorker(sched, hazard=lambda rid, loop, pos: 1.0)  # a token per traversal
    a = worker.add(make_request("a", 2, 12, threshold=0.5))
    b = worker.add(make_request("b", 2, 12, threshold=0.5))
    seen: list[tuple[str, int]] = []

    def stop_check(req: Request) -> bool:
        seen.append((req.request_id, req.output_token_ids[-1]))
        return req is a and len(req.output_token_ids) == 3

    got = worker.step(stop_check)
    assert got == [a, b]
    assert a.finished and a.finish_reason == "stop" and len(a.output_token_ids) == 3
    assert len(b.output_token_ids) == 6  # b keeps every token of the window
    # the callback saw every accepted token, in event order, and none of a's after the stop
    assert [rid for rid, _ in seen] == ["a", "b", "a", "b", "a", "b", "b", "b", "b"]
    a_events = [e for e in worker.results[0].events if e.slot == worker.plans[0].slot_inits[0].slot]
    assert len(a_events) == 6  # the device ran a's whole window: the host dropped 3
    worker.step(stop_check)
    assert a.slot is None and worker.plans[-1].slot_frees == (0,)
    assert 0 not in worker.slots  # the freed slot no longer runs
    worker.drain(stop_check=stop_check)
    assert (a.output_token_ids, a.exit_depths) == tuple(x[:3] for x in expected_outputs(worker, a))
    check_outputs(worker, [b])
    assert_clean(worker)


def test_stop_check_on_the_last_allowed_token_reports_stop():
    sched = make_scheduler(decode_window=3)
    worker = FakeWorker(sched)
    req = worker.add(make_request("a", 2, 3))
    worker.drain(stop_check=lambda r: len(r.output_token_ids) == 3)
    assert req.finish_reason == "stop" and len(req.output_token_ids) == 3
    assert_clean(worker)


# -- refill versus no-refill ----------------------------------------------------------------


def _two_request_trace(refill: bool, window: int = 1) -> tuple[FakeWorker, Request, Request]:
    sched = make_scheduler(refill=refill, decode_window=window)

    def hazard(rid: str, loop: int, pos: int) -> float:
        return 1.0 if rid == "early" else 0.0

    worker = FakeWorker(sched, hazard)
    early = worker.add(make_request("early", 2, 4, threshold=0.5))
    late = worker.add(make_request("late", 2, 4, threshold=0.5))
    worker.drain()
    return worker, early, late


@pytest.mark.parametrize("window", [1, 2, 5])
def test_refill_mixes_depths_in_one_traversal(window):
    worker, early, late = _two_request_trace(refill=True, window=window)
    assert early.exit_depths == [DEPTH, 1, 1, 1] and late.exit_depths == [DEPTH] * 4
    mixed = [t for t in worker.traversals if len({r.loop for r in t}) > 1]
    assert mixed, "refill must let the early exiter rejoin while the other is mid-loop"
    # the early exiter never waits: it runs in every traversal until it is done
    runs = [any(r.rid == "early" for r in t) for t in worker.traversals]
    assert runs[:3] == [True] * 3 and not any(runs[3:])
    check_outputs(worker, [early, late])
    assert_clean(worker)


@pytest.mark.parametrize("window", [1, 2, 5])
def test_no_refill_cohort_waits_for_its_slowest_token(window):
    worker, early, late = _two_request_trace(refill=False, window=window)
    assert early.exit_depths == [DEPTH, 1, 1, 1] and late.exit_depths == [DEPTH] * 4
    for t in worker.traversals:
        assert len({r.loop for r in t}) <= 1, t
    # the early token is sampled when it exits, but its successor waits for the late one:
    # the cohort (both at loop 0) starts every DEPTH traversals
    starts = [i for i, t in enumerate(worker.traversals) if any(r.rid == "early" for r in t)]
    assert starts == [0, DEPTH, 2 * DEPTH]
    for i in starts:
        assert sorted((r.rid, r.loop) for r in worker.traversals[i]) == [
            ("early", 0),
            ("late", 0),
        ]
    check_outputs(worker, [early, late])
    assert_clean(worker)


def test_no_refill_max_loops_exit_also_waits_for_the_cohort():
    sched = make_scheduler(refill=False, decode_window=3)
    worker = FakeWorker(sched)
    short = worker.add(make_request("short", 2, 3, max_loops=2))
    full = worker.add(make_request("full", 2, 3))
    worker.drain()
    for t in worker.traversals:
        assert len({r.loop for r in t}) <= 1, t
    check_outputs(worker, [short, full])
    assert_clean(worker)


def test_no_refill_a_late_prefill_joins_at_the_next_cohort():
    sched = make_scheduler(refill=False, decode_window=2)
    worker = FakeWorker(sched)
    first = worker.add(make_request("first", 2, 4))
    worker.step()  # prefill, then loops 0 and 1 of position 2
    assert worker.slots[first.slot].loop == 2
    second = worker.add(make_request("second", 2, 4))  # its prefill ends mid-token
    worker.drain()
    for t in worker.traversals:
        assert len({r.loop for r in t}) <= 1, t
    joined = next(i for i, t in enumerate(worker.traversals) if any(r.rid == "second" for r in t))
    assert joined % DEPTH == 0  # at a cohort boundary
    check_outputs(worker, [first, second])
    assert_clean(worker)


# -- structured output -----------------------------------------------------------------------


def test_a_constrained_requests_masks_travel_in_its_slot_init_then_one_update_per_token():
    """The first mask rides the SlotInit; each later one goes out once, in the next plan, to
    the slot the request holds; windows are cut to a token's loops when every running row
    is constrained (each emits at most one token a window); a constrained row is never
    handed on early (it may wait for its masks), where a free one would be."""
    for constrained in (True, False):
        sched = make_scheduler(decode_window=8, lookahead=2)
        req = make_request("c", 3, 2)
        if constrained:
            spec = StructuredOutput(regex="[a-z]+")
            req.params = dataclasses.replace(req.params, structured=spec)
            req.token_mask = b"first"
        sched.add(req)
        plan = sched.schedule()
        assert plan.slot_inits[0].token_mask == (b"first" if constrained else b"")
        assert req.token_mask == b"" and plan.mask_updates == ()
        first = TokenEvent(req.slot, Sample(token_for("c", 2)), DEPTH)
        sched.update(plan, StepResult((first,)))
        if constrained:
            req.token_mask = b"second"  # what the engine's grammar does after a token
        plan = sched.schedule()
        want = (MaskUpdate(req.slot, b"second"),) if constrained else ()
        assert plan.mask_updates == want and req.token_mask == b""
        assert plan.decode_traversals == DEPTH  # (one token left: both windows are cut)
        sched.add(make_request("q", 3, 2))  # queued: someone to hand the slot on to
        sched.schedule()
        assert (req in sched.retiring) is not constrained


@pytest.mark.parametrize("constrained", [True, False])
def test_windows_are_a_tokens_loops_when_every_row_is_constrained(constrained):
    sched = make_scheduler(decode_window=8)
    req = make_request("c", 3, 6, max_loops=3)
    if constrained:
        spec = StructuredOutput(choice=("a", "b"))
        req.params = dataclasses.replace(req.params, structured=spec)
    sched.add(req)
    plan = sched.schedule()
    assert plan.wave_rides and plan.decode_traversals == (DEPTH if constrained else 8)
    sched.update(plan, StepResult((TokenEvent(req.slot, Sample(token_for("c", 2)), DEPTH),)))
    assert sched.schedule().decode_traversals == (3 if constrained else 8)
