"""Admission and memory policies, pure Python: hand-built StepResults, no torch, no model.

`SwapWorker` plays the model like the scheduler tests' fake worker, and also plays the
worker's side of preemption. It keeps a ledger of what every KV slot holds, moves that ledger
(and the slot's device state: the hidden "unit in flight" and the request's RNG identity) to a
host snapshot on `SwapOut` and back into the new blocks and slot on `SwapIn`, and checks that
every row reads exactly the K/V its layout promises:

- LAST_EXITED: at loop d, earlier position q holds its version min(d, exit loop of q);
- SHARED: earlier position q holds its final version (its exit loop; prompt: the last loop).

Prompt positions are recorded by their token prefix rather than by request, so a row reading a
prefix block another request computed (prefix caching) passes exactly when the prefix matches.
Hazards and sampled tokens are deterministic functions of (request, loop, position).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from scheduler_helpers import DEPTH, Hazard, make_scheduler, token_for

from rlt_engine.config import SchedulerConfig
from rlt_engine.core.exit_rule import ExitTracker, LoopControls
from rlt_engine.core.plan import (
    CodaRow,
    RecurrentRow,
    Sample,
    Stage,
    StepPlan,
    StepResult,
    SwapOut,
)
from rlt_engine.core.request import Request
from rlt_engine.core.scheduler import Scheduler
from rlt_engine.sampling_params import SamplingParams

_SEEDS = iter(range(1, 10**9))


def make_request(
    rid: str,
    prompt: int | list[int] = 3,
    max_tokens: int = 4,
    *,
    priority: int = 0,
    min_loops: int = 1,
    max_loops: int = DEPTH,
    threshold: float = 1.0,
) -> Request:
    tokens = [10 + i for i in range(prompt)] if isinstance(prompt, int) else list(prompt)
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        params=SamplingParams(max_tokens=max_tokens, priority=priority),
        controls=LoopControls(min_loops, max_loops, threshold),
        stop_token_ids=frozenset(),
        seed=next(_SEEDS),  # unique: identifies the request's RNG state in the worker
    )


@dataclass
class _Snapshot:
    kv: list[tuple | None]
    hidden: tuple | None
    seed: int


@dataclass
class SwapWorker:
    sched: Scheduler
    hazard: Hazard = lambda rid, loop, pos: 0.0
    kv: dict[int, tuple] = field(default_factory=dict)  # KV slot -> what it holds
    rng: dict[int, int] = field(default_factory=dict)  # batch slot -> request seed
    hidden: dict[int, tuple] = field(default_factory=dict)  # batch slot -> unit in flight
    snapshots: dict[int, _Snapshot] = field(default_factory=dict)
    requests: dict[str, Request] = field(default_factory=dict)
    exit_loop: dict[tuple[str, int], int] = field(default_factory=dict)
    plans: list[StepPlan] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.bs = self.sched.blocks.block_size
        self.shared = self.sched.shared

    # -- test driving ------------------------------------------------------------------
    def add(self, req: Request) -> Request:
        self.requests[req.request_id] = req
        self.sched.add(req)
        return req

    def step(self) -> list[Request]:
        plan = self.sched.schedule()
        if plan is None:
            idle = self.sched.bookkeeping_plan()
            if idle is not None:
                self.execute(idle)
            return []
        return self.sched.update(plan, self.execute(plan))

    def drain(self, max_steps: int = 5_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                self.step()  # flush pending bookkeeping (slot frees, snapshot drops)
                return
            self.step()
        raise AssertionError("the scheduler did not drain")

    def expected_exit_loop(self, rid: str, pos: int) -> int:
        req = self.requests[rid]
        if pos < req.prompt_len:
            return self.sched.depth - 1
        tracker = ExitTracker(req.controls)
        while not tracker.step(self.hazard(rid, tracker.loops_done, pos)):
            pass
        return tracker.loops_done - 1

    def expected_outputs(self, req: Request) -> tuple[list[int], list[int]]:
        tokens, depths = [], []
        pos = req.prompt_len - 1
        while True:
            tokens.append(token_for(req.request_id, pos))
            depths.append(self.expected_exit_loop(req.request_id, pos) + 1)
            if len(tokens) >= req.params.max_tokens:
                return tokens, depths
            pos += 1

    def swap_outs(self) -> list[SwapOut]:
        return [s for p in self.plans for s in p.swap_outs]

    # -- the worker ----------------------------------------------------------------------
    def _slots(self, blocks: tuple[int, ...]) -> list[int]:
        return [b * self.bs + o for b in blocks for o in range(self.bs)]

    def _key(self, req: Request, pos: int, version: int) -> tuple:
        if pos < req.prompt_len:  # by content: valid for every request with this prefix
            return ("prompt", tuple(req.prompt_token_ids[: pos + 1]), version)
        return (req.request_id, pos, version)

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for copy in plan.kv_copies:
            for dst in copy.dst:
                self.kv[dst] = self.kv[copy.src]
        for out in plan.swap_outs:
            assert out.snapshot not in self.snapshots
            self.snapshots[out.snapshot] = _Snapshot(
                [self.kv.get(s) for s in self._slots(out.blocks)],
                self.hidden.pop(out.slot, None),
                self.rng.pop(out.slot),
            )
        for slot in plan.slot_frees:
            self.rng.pop(slot, None)
            self.hidden.pop(slot, None)
        for snapshot in plan.snapshot_drops:
            del self.snapshots[snapshot]
        for init in plan.slot_inits:
            assert init.slot not in self.rng, "a slot was initialised while still in use"
            self.rng[init.slot] = init.seed
        for swap_in in plan.swap_ins:
            snap = self.snapshots.pop(swap_in.snapshot)
            slots = self._slots(swap_in.blocks)
            assert len(slots) == len(snap.kv), "a snapshot restored into a different size"
            for s, entry in zip(slots, snap.kv, strict=True):
                if entry is not None:
                    self.kv[s] = entry
            assert swap_in.slot not in self.rng
            self.rng[swap_in.slot] = snap.seed
            if snap.hidden is not None:
                self.hidden[swap_in.slot] = snap.hidden
        if plan.stage is Stage.CODA:
            samples = []
            for row in plan.rows:
                assert isinstance(row, CodaRow)
                req = self.requests[row.request_id]
                assert self.rng[row.slot] == req.seed, "slot state does not follow the request"
                rid, _, end, loop = self.hidden[row.slot]
                assert rid == req.request_id and loop == self.expected_exit_loop(rid, end - 1)
                samples.append(Sample(token_for(rid, end - 1)))
            return StepResult(hazards=(None,) * len(plan.rows), samples=tuple(samples))
        assert plan.num_tokens <= self.sched.config.max_num_batched_tokens
        hazards, samples = [], []
        for row in plan.rows:
            assert isinstance(row, RecurrentRow)
            hazards.append(self._run_row(row))
            end = row.start + row.num_tokens
            samples.append(Sample(token_for(row.request_id, end - 1)) if row.sample else None)
        return StepResult(hazards=tuple(hazards), samples=tuple(samples))

    def _run_row(self, row: RecurrentRow) -> float | None:
        rid, loop = row.request_id, row.loop
        req = self.requests[rid]
        assert self.rng[row.slot] == req.seed, "slot state does not follow the request"
        end = row.start + row.num_tokens
        if loop == 0:
            assert row.token_ids is not None
        else:  # the hidden state of this very unit, one loop earlier
            assert row.token_ids is None
            assert self.hidden[row.slot] == (rid, row.start, end, loop - 1)
        if self.shared:
            assert row.num_tokens == 1, "SHARED prefill must advance position by position"
        for q in range(row.start):
            final = self.exit_loop[(rid, q)] if (rid, q) in self.exit_loop else DEPTH - 1
            version = final if self.shared else min(loop, final)
            slot = row.block_table[q // self.bs] * self.bs + q % self.bs
            assert self.kv.get(slot) == self._key(req, q, version), (rid, loop, q)
        for q in range(row.start, end):
            self.kv[row.block_table[q // self.bs] * self.bs + q % self.bs] = self._key(req, q, loop)
        self.hidden[row.slot] = (rid, row.start, end, loop)
        pos = end - 1
        if row.start >= req.prompt_len:
            exit_loop = self.expected_exit_loop(rid, pos)
            assert loop <= exit_loop
            if loop == exit_loop:
                self.exit_loop[(rid, pos)] = exit_loop
        return self.hazard(rid, loop, pos)


def assert_clean(worker: SwapWorker) -> None:
    sched = worker.sched
    assert sched.blocks.num_used == 0
    assert not sched.has_unfinished()
    assert not sched.has_pending_ops()
    assert sorted(sched._free_slots) == list(range(sched.config.max_num_seqs))
    assert worker.snapshots == {} and worker.rng == {} and worker.hidden == {}


def check_outputs(worker: SwapWorker, reqs: list[Request]) -> None:
    for req in reqs:
        assert req.finish_reason == "length", req.request_id
        assert (req.output_token_ids, req.exit_depths) == worker.expected_outputs(req)


def admission_order(worker: SwapWorker, max_steps: int = 2_000) -> list[str]:
    """Drain, recording the order in which requests first leave the waiting queue."""
    order: list[str] = []
    for _ in range(max_steps):
        worker.step()
        for req in worker.sched.running:
            if req.request_id not in order:
                order.append(req.request_id)
        if not worker.sched.has_unfinished():
            worker.step()
            return order
    raise AssertionError("the scheduler did not drain")


# -- queue order ---------------------------------------------------------------------------


def test_fcfs_is_the_default_and_ignores_priorities():
    assert SchedulerConfig().scheduling_policy == "fcfs"
    worker = SwapWorker(make_scheduler(max_num_seqs=1))
    reqs = [worker.add(make_request(f"r{i}", 2, 2, priority=p)) for i, p in enumerate([3, 0, 1])]
    assert admission_order(worker) == ["r0", "r1", "r2"]
    check_outputs(worker, reqs)
    assert_clean(worker)


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_priority_admits_lower_values_first_and_ties_in_arrival_order(max_num_seqs):
    worker = SwapWorker(make_scheduler(max_num_seqs=max_num_seqs, scheduling_policy="priority"))
    prios = [2, 0, 1, 0, 2, 1]
    reqs = [worker.add(make_request(f"r{i}", 2, 3, priority=p)) for i, p in enumerate(prios)]
    order = admission_order(worker)
    assert order == [f"r{i}" for i in sorted(range(6), key=lambda i: (prios[i], i))]
    check_outputs(worker, reqs)
    assert_clean(worker)


def test_a_candidate_that_does_not_fit_is_not_overtaken():
    # priority order: "big" is best but does not fit yet; "small" (worse) fits but must wait
    worker = SwapWorker(make_scheduler(num_blocks=16, scheduling_policy="priority"))
    first = worker.add(make_request("first", 3, 2, priority=5))  # 4 positions: 8 blocks
    worker.step()
    big = worker.add(make_request("big", 5, 2, priority=0))  # 6 positions: 12 blocks
    small = worker.add(make_request("small", 1, 1, priority=1))  # 1 position: 4 blocks
    worker.step()
    assert big.stage is Stage.WAITING and small.stage is Stage.WAITING
    worker.drain()
    check_outputs(worker, [first, big, small])
    assert_clean(worker)


# -- bounded bypass --------------------------------------------------------------------------


def _stream_of_urgent_arrivals(worker: SwapWorker, low: Request, limit: int) -> int:
    """Keep one high-priority request waiting at all times; returns how many were admitted
    after `low` arrived and before it was (re)admitted."""
    sched, n, overtakes = worker.sched, 0, 0
    for _ in range(limit):
        if not any(r.params.priority == 0 for r in sched.waiting):
            worker.add(make_request(f"h{n}", 2, 2, priority=0))
            n += 1
        before = {r.request_id for r in sched.running}
        worker.step()
        if low in sched.running:
            return overtakes
        overtakes += len({r.request_id for r in sched.running} - before)
    raise AssertionError(f"{low.request_id} starved: {overtakes} requests overtook it")


@pytest.mark.parametrize("max_bypass", [1, 3])
def test_bounded_bypass_admits_a_waiting_low_priority_request(max_bypass):
    worker = SwapWorker(
        make_scheduler(max_num_seqs=1, scheduling_policy="priority", max_bypass=max_bypass)
    )
    worker.add(make_request("h-first", 2, 2, priority=0))
    low = worker.add(make_request("low", 3, 3, priority=9))
    assert _stream_of_urgent_arrivals(worker, low, 500) == max_bypass + 1  # h-first, then bound
    assert low.bypassed == max_bypass
    while worker.sched.has_unfinished():  # stop the stream and drain
        worker.step()
    worker.drain()
    check_outputs(worker, [low])
    assert_clean(worker)


def test_without_the_bound_the_stream_would_starve_it():
    worker = SwapWorker(make_scheduler(max_num_seqs=1, scheduling_policy="priority"))
    worker.add(make_request("h-first", 2, 2, priority=0))
    low = worker.add(make_request("low", 3, 3, priority=9))
    with pytest.raises(AssertionError, match="starved"):
        _stream_of_urgent_arrivals(worker, low, 60)  # max_bypass=32 needs more steps
    worker.drain()
    assert_clean(worker)


def test_bounded_bypass_also_covers_preempted_requests():
    # regression: only waiting requests used to count bypasses, so a preempted one starved
    worker = SwapWorker(
        make_scheduler(
            max_num_seqs=1, scheduling_policy="priority", enable_preemption=True, max_bypass=2
        )
    )
    low = worker.add(make_request("low", 3, 6, priority=9))
    worker.step()
    worker.step()
    assert low in worker.sched.running
    # the first urgent arrival preempts it; then keep one urgent request waiting at all times
    overtakes = _stream_of_urgent_arrivals(worker, low, 300)
    assert low.num_preemptions == 1 and worker.swap_outs()
    assert 1 <= overtakes <= 2  # resumed once promoted: overtaken at most max_bypass times
    while worker.sched.has_unfinished():
        worker.step()
    worker.drain()
    check_outputs(worker, [low])
    assert_clean(worker)


# -- priority preemption ---------------------------------------------------------------------


def test_priority_preemption_takes_the_worst_strictly_lower_priority_request():
    worker = SwapWorker(
        make_scheduler(max_num_seqs=2, scheduling_policy="priority", enable_preemption=True)
    )
    a = worker.add(make_request("a", 3, 6, priority=1))
    b = worker.add(make_request("b", 2, 6, priority=1))
    for _ in range(DEPTH + 2):
        worker.step()
    same = worker.add(make_request("same", 2, 2, priority=1))  # equal priority: waits
    worker.step()
    assert same.stage is Stage.WAITING and worker.swap_outs() == []
    b_blocks = tuple(x for t in worker.sched.blocks.owned_blocks("b") for x in t)
    urgent = worker.add(make_request("urgent", 2, 2, priority=0))
    worker.step()
    (out,) = worker.swap_outs()
    assert out.blocks == b_blocks  # every plane of the later-arrived equal-rank victim
    assert b.stage is not Stage.FINISHED and b in worker.sched.swapped
    assert b.num_preemptions == 1 and a.num_preemptions == 0 and a in worker.sched.running
    assert urgent in worker.sched.running
    worker.drain()
    check_outputs(worker, [a, b, same, urgent])
    swap_ins = [s for p in worker.plans for s in p.swap_ins]
    assert [s.snapshot for s in swap_ins] == [out.snapshot]
    assert len(swap_ins[0].blocks) == len(out.blocks)
    assert worker.sched.num_preemptions == 1
    assert_clean(worker)


@pytest.mark.parametrize(
    ("policy", "preemption"), [("fcfs", True), ("priority", False), ("fcfs", False)]
)
def test_no_priority_preemption_unless_priority_and_preemption_are_both_on(policy, preemption):
    worker = SwapWorker(
        make_scheduler(max_num_seqs=1, scheduling_policy=policy, enable_preemption=preemption)
    )
    low = worker.add(make_request("low", 3, 4, priority=5))
    worker.step()
    urgent = worker.add(make_request("urgent", 2, 2, priority=0))
    while not low.finished:
        worker.step()
        assert urgent.stage is Stage.WAITING or low.finished
    worker.drain()
    assert worker.swap_outs() == []
    check_outputs(worker, [low, urgent])
    assert_clean(worker)


def test_pending_exit_copies_land_before_the_copy_out():
    # "a" exits its second token after loop 0 (a KV copy into planes 1..3 is then pending);
    # an urgent arrival preempts it right then: the copy must be in the snapshot
    def hazard(rid: str, loop: int, pos: int) -> float:
        return 1.0 if rid == "a" else 0.0

    worker = SwapWorker(
        make_scheduler(
            max_num_seqs=1, scheduling_policy="priority", enable_preemption=True, block_size=3
        ),
        hazard,
    )
    a = worker.add(make_request("a", 3, 5, priority=5, threshold=0.5))
    while a.stage is not Stage.CODA:
        worker.step()
    assert a.pending_copies
    copies = list(a.pending_copies)
    urgent = worker.add(make_request("urgent", 2, 2, priority=0))
    worker.step()
    plan = worker.plans[-1]
    assert [s.slot for s in plan.swap_outs] == [0] and a in worker.sched.swapped
    assert set(copies) <= set(plan.kv_copies)
    worker.drain()  # the resumed "a" reads planes 1..3 at its exit version: the ledger checks
    check_outputs(worker, [a, urgent])
    assert a.exit_depths[1:] == [1] * 4
    assert_clean(worker)


def test_abort_while_swapped_drops_the_snapshot_and_frees_nothing_twice():
    worker = SwapWorker(
        make_scheduler(max_num_seqs=1, scheduling_policy="priority", enable_preemption=True)
    )
    low = worker.add(make_request("low", 3, 6, priority=5))
    for _ in range(DEPTH + 1):
        worker.step()
    urgent = worker.add(make_request("urgent", 2, 4, priority=0))
    worker.step()
    assert low in worker.sched.swapped and len(worker.snapshots) == 1
    used = worker.sched.blocks.num_used
    assert worker.sched.abort("low") is low
    assert low.finish_reason == "abort" and low.snapshot is None
    assert worker.sched.blocks.num_used == used  # its pages were already free
    worker.step()
    assert worker.plans[-1].snapshot_drops and worker.snapshots == {}
    worker.drain()
    check_outputs(worker, [urgent])
    assert_clean(worker)


def test_abort_of_the_last_request_while_swapped_leaves_a_bookkeeping_plan():
    worker = SwapWorker(
        make_scheduler(max_num_seqs=1, scheduling_policy="priority", enable_preemption=True)
    )
    low = worker.add(make_request("low", 3, 6, priority=5))
    for _ in range(DEPTH + 1):
        worker.step()
    worker.add(make_request("urgent", 2, 8, priority=0))
    worker.step()
    assert low in worker.sched.swapped
    worker.sched.abort("urgent")
    worker.sched.abort("low")
    assert not worker.sched.has_unfinished() and worker.sched.schedule() is None
    idle = worker.sched.bookkeeping_plan()
    assert idle is not None and idle.rows == () and len(idle.snapshot_drops) == 1
    worker.execute(idle)
    assert worker.sched.bookkeeping_plan() is None
    assert_clean(worker)


# -- incremental allocation and memory-pressure preemption -----------------------------------


def test_incremental_tables_grow_on_every_plane_as_the_request_advances():
    sched = make_scheduler(block_size=2, incremental_kv=True)
    worker = SwapWorker(sched)
    req = worker.add(make_request("a", 3, 8))  # 10 positions in its lifetime: 5 per plane
    seen = []
    while not req.finished:
        worker.step()
        if req.block_tables is not None:
            lengths = {len(t) for t in req.block_tables}
            assert len(lengths) == 1  # all planes together
            seen.append(lengths.pop())
            # exactly the blocks the written positions need (the prompt's at admission)
            assert seen[-1] == -(-max(*req.written, req.prompt_len) // 2)
    assert seen[0] == 2 and max(seen) == 5 and seen == sorted(seen)
    worker.drain()
    check_outputs(worker, [req])
    assert_clean(worker)


def test_incremental_without_preemption_admits_only_what_can_grow_to_full_length():
    # block 2, 4 planes, 32 blocks: 8 per plane. Lifetimes: 8 positions (4 per plane) each
    sched = make_scheduler(num_blocks=32, incremental_kv=True, max_num_seqs=4)
    worker = SwapWorker(sched)
    reqs = [worker.add(make_request(f"r{i}", 1, 8)) for i in range(3)]
    worker.step()
    # each holds one block per plane now, but only two can grow to 4 per plane
    assert [r.stage for r in reqs] == [Stage.PREFILL, Stage.PREFILL, Stage.WAITING]
    assert sched.blocks.num_used == 8
    while sched.has_unfinished():  # growth never fails ("KV growth failed" would raise)
        worker.step()
        assert sched.blocks.num_used <= sched.blocks.num_blocks
    worker.drain()
    check_outputs(worker, reqs)
    assert worker.swap_outs() == []
    assert_clean(worker)


@pytest.mark.parametrize("kv_layout", ["last_exited", "shared"])
def test_memory_pressure_preempts_the_worst_ranked_request_and_resumes_it_exactly(kv_layout):
    # pool barely larger than one request's lifetime; two grow at once until one must go
    planes = 1 if kv_layout == "shared" else DEPTH
    sched = make_scheduler(
        num_blocks=planes * 6,
        incremental_kv=True,
        enable_preemption=True,
        kv_layout=kv_layout,
        max_num_seqs=2,
    )
    worker = SwapWorker(sched, hazard=lambda rid, loop, pos: 0.4)
    first = worker.add(make_request("first", 2, 9, threshold=0.6))  # 10 positions: 5 / plane
    second = worker.add(make_request("second", 3, 8, threshold=0.6))
    worker.drain()
    outs = worker.swap_outs()
    assert outs and second.num_preemptions >= 1 and first.num_preemptions == 0
    check_outputs(worker, [first, second])
    assert_clean(worker)


@pytest.mark.parametrize(("watermark", "b_waits"), [(0.25, True), (0.0, False)])
def test_watermark_keeps_blocks_free_when_admitting(watermark, b_waits):
    sched = make_scheduler(
        num_blocks=32, incremental_kv=True, enable_preemption=True, watermark=watermark
    )  # 0.25: 8 blocks stay free at admission
    worker = SwapWorker(sched)
    a = worker.add(make_request("a", 7, 2))  # 4 per plane: 16 blocks
    b = worker.add(make_request("b", 5, 2))  # 3 per plane: 12 blocks; 16 free - 12 < 8
    worker.step()
    assert a.stage is Stage.PREFILL
    assert (b.stage is Stage.WAITING) == b_waits
    worker.drain()
    check_outputs(worker, [a, b])
    assert_clean(worker)


def test_a_request_that_fits_the_pool_is_never_stuck_behind_the_watermark():
    # regression: the watermark used to apply to a lone candidate too (it waited forever)
    sched = make_scheduler(
        num_blocks=16, incremental_kv=True, enable_preemption=True, watermark=0.25
    )
    worker = SwapWorker(sched)
    req = worker.add(make_request("a", 8, 1))  # 8 positions: exactly the 16 blocks
    worker.drain(max_steps=200)
    check_outputs(worker, [req])


# -- randomized: every policy together ---------------------------------------------------------


@pytest.mark.parametrize("seed", range(30))
def test_random_workloads_under_every_policy_match_serial_semantics(seed):
    rng = random.Random(seed)
    kv_layout = rng.choice(["last_exited", "shared"])
    planes = 1 if kv_layout == "shared" else DEPTH
    block_size = rng.choice([1, 2, 3])
    bases = [[rng.randrange(10, 60) for _ in range(9)] for _ in range(2)]
    specs = []
    for i in range(rng.randint(3, 8)):
        max_loops = rng.randint(1, DEPTH)
        prompt = [*rng.choice(bases)[: rng.randint(0, 9)], rng.randrange(10, 60)]
        req = make_request(
            f"r{i}",
            prompt,
            rng.randint(1, 6),
            priority=rng.randint(0, 3),
            min_loops=rng.randint(1, max_loops),
            max_loops=max_loops,
            threshold=rng.choice([0.0, 0.3, 0.6, 1.0]),
        )
        arrive = rng.choice([0, rng.randint(0, 30)])
        abort = rng.randint(0, 60) if rng.random() < 0.25 else None
        specs.append((arrive, abort, req))
    largest = max(planes * -(-r.max_positions // block_size) for _, _, r in specs)
    max_num_seqs = rng.randint(1, 4)
    sched = make_scheduler(
        kv_layout=kv_layout,
        block_size=block_size,
        num_blocks=largest + rng.choice([0, planes, 3 * planes]),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=rng.randint(max_num_seqs, 12),
        prefill_chunk_size=rng.randint(1, 8),
        refill=rng.random() < 0.7,
        enable_prefix_caching=kv_layout == "last_exited" and rng.random() < 0.5,
        incremental_kv=rng.random() < 0.7,
        enable_preemption=rng.random() < 0.6,
        scheduling_policy=rng.choice(["fcfs", "priority"]),
        max_bypass=rng.randint(1, 4),
    )
    salt = rng.random()

    def hazard(rid: str, loop: int, pos: int) -> float:
        return random.Random(f"{salt}/{rid}/{loop}/{pos}").random() ** 2

    worker = SwapWorker(sched, hazard)
    aborted = set()
    for step in range(5_000):
        for arrive, abort, req in specs:
            if arrive == step:
                worker.add(req)
            if abort == step and sched.abort(req.request_id) is not None:
                aborted.add(req.request_id)
        if step > 60 and not sched.has_unfinished():
            break
        worker.step()
        assert len(sched.running) <= max_num_seqs
        tables = [sched.blocks.owned_blocks(r.request_id) for r in sched.running]
        held = {b for owned in tables for t in owned for b in t}
        assert len(held) == sched.blocks.num_used <= sched.blocks.num_blocks
    else:
        raise AssertionError("the scheduler did not drain")
    worker.step()  # pending bookkeeping of the last aborts
    assert_clean(worker)
    check_outputs(worker, [r for _, _, r in specs if r.request_id not in aborted])
