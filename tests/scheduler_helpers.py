"""Shared by the scheduler unit tests (tests/core/): pure Python, no torch.

`FakeWorker` plays the device side of the step contract (`core/plan.py`) the way
`worker/model_runner.py`, `worker/slot_batch.py` and `worker/decode.py` do, in plain Python:

- a slot table mirroring the plan's diffs: `SlotInit` creates a slot with its tables,
  `BlockAppend` appends to them, `SwapOut` snapshots the slot state and the KV ledger of its
  blocks (and releases the slot), `SwapIn` restores both into new blocks and a new slot, frees
  and snapshot drops forget them;
- prefill chunks through every loop, writing the KV ledger at every loop of every plane
  (SHARED: the one plane, overwritten loop by loop); a `last` chunk samples the first token
  (exit depth = model depth) and starts its slot decoding in the same step's window;
- a decode window of `decode_traversals` traversals: rows at mixed loops, the exit rule is the
  real `ExitTracker` over a deterministic hazard (request id, loop, position) -> hazard,
  exiting rows sample and re-enter at loop 0 in the next traversal (refill) or park until
  every active slot has exited (no-refill; the release is checked at the start of a traversal),
  a slot deactivates itself on a stop id or its max_tokens-th token, and a token that exits
  after loop e lends its version e to planes e+1..D-1 (LAST_EXITED exit copies);
- token events in emission order: first tokens of the prefill waves, then traversal by
  traversal in slot order.

The ledger records which (request, position, version) each KV slot holds; prompt positions are
recorded by their token prefix instead of the request, so reading a prefix block another
request computed (prefix caching) passes exactly when the prefixes match. It CHECKS that every
read (prefill and decode) finds the right token at the version its layout promises
(LAST_EXITED: min(loop, exit loop); SHARED: the earlier position's final version), that no
write or read goes past the end of a table (the scheduler must reserve every block a window
needs before it runs: tables cover min(position + window, max_positions)), that the mirror of
the tables equals the scheduler's after every plan, that a window never exceeds the configured
decode window, that no decode row attends to more keys than its plan's `decode_keys` bound (the
worker's attention launch plan follows it), and that only slots of unfinished requests run.
Sampled tokens are `token_for(request id, position)`.
"""

from __future__ import annotations

import copy
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rlt_engine.config import CacheConfig, SchedulerConfig
from rlt_engine.core.block_manager import BlockManager
from rlt_engine.core.exit_rule import ExitTracker, LoopControls
from rlt_engine.core.plan import (
    PrefillChunk,
    Sample,
    Stage,
    StepPlan,
    StepResult,
    SwapOut,
    TokenEvent,
)
from rlt_engine.core.request import Request
from rlt_engine.core.scheduler import Scheduler, StopCheck
from rlt_engine.sampling_params import SamplingParams

DEPTH = 4

Hazard = Callable[[str, int, int], float | None]  # (request id, loop, position) -> hazard

_SEEDS = itertools.count(1)


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
    decode_window: int = 1,
    lookahead: int = 1,
    max_ride_rows: int | None = None,
    scheduler_class: type[Scheduler] = Scheduler,
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
    return scheduler_class(
        config, blocks, depth, cache, decode_window, lookahead, max_ride_rows=max_ride_rows
    )


def make_request(
    rid: str,
    prompt: int | list[int] = 3,
    max_tokens: int = 4,
    *,
    priority: int = 0,
    min_loops: int = 1,
    max_loops: int = DEPTH,
    threshold: float = 1.0,
    stop: tuple[int, ...] = (),
) -> Request:
    """`prompt`: a length (tokens 10, 11, ...) or the token ids."""
    tokens = [10 + i for i in range(prompt)] if isinstance(prompt, int) else list(prompt)
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        params=SamplingParams(max_tokens=max_tokens, priority=priority),
        controls=LoopControls(min_loops, max_loops, threshold),
        stop_token_ids=frozenset(stop),
        seed=next(_SEEDS),  # unique: the fake worker identifies a slot's request by its seed
    )


def token_for(rid: str, position: int) -> int:
    """The token the fake model samples after running `position` of request `rid`."""
    return 100 + (position * 7 + sum(map(ord, rid))) % 50


@dataclass
class FakeSlot:
    """One slot of the device batch (what `SlotBatch` holds for it)."""

    req: Request  # identified by the SlotInit's seed; the device knows no request ids
    tables: list[list[int]]
    prefilled: int | None = None  # prompt positions done (None: no chunk ran yet)
    token: int | None = None  # the token in flight (embedded at loop 0)
    position: int = 0  # its position
    loop: int = 0  # loops it has finished
    tracker: ExitTracker | None = None  # its exit mass
    generated: int = 0  # tokens emitted
    active: bool = False  # decoding
    parked: bool = False  # no-refill: exited, waits for the cohort


@dataclass
class _Snapshot:
    state: FakeSlot
    kv: list[tuple | None]  # ledger of every slot of its blocks, in SwapOut order
    lengths: list[int]  # blocks per plane


@dataclass
class Row:
    """One row of one decode traversal."""

    rid: str
    loop: int
    position: int


@dataclass
class FakeWorker:
    sched: Scheduler
    hazard: Hazard = lambda rid, loop, pos: 0.0
    check_reservation: bool = True  # tables cover every window's reach when the plan leaves
    exit_copies: bool = True  # False plays a broken device (the ledger must catch it)
    slots: dict[int, FakeSlot] = field(default_factory=dict)
    kv: dict[int, tuple] = field(default_factory=dict)  # KV slot -> what it holds
    snapshots: dict[int, _Snapshot] = field(default_factory=dict)
    requests: dict[str, Request] = field(default_factory=dict)
    exit_loop: dict[tuple[str, int], int] = field(default_factory=dict)  # 0-based, as run
    plans: list[StepPlan] = field(default_factory=list)
    results: list[StepResult] = field(default_factory=list)
    traversals: list[list[Row]] = field(default_factory=list)  # every traversal's rows
    windows: list[tuple[int, int]] = field(default_factory=list)  # per plan: traversal range
    tables_seen: dict[str, list[list[int]]] = field(default_factory=dict)  # request -> last
    # executed plans whose results are not applied yet (planning a window ahead: at most one
    # between steps)
    launched: deque[tuple[StepPlan, StepResult]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.bs = self.sched.blocks.block_size
        self.depth = self.sched.depth
        self.shared = self.sched.shared
        self.refill = self.sched.config.refill
        self.window = self.sched.decode_window  # the device's event buffers hold this many
        self._by_seed: dict[int, Request] = {}

    # -- test driving ------------------------------------------------------------------
    def track(self, req: Request) -> Request:
        assert req.seed not in self._by_seed or self._by_seed[req.seed] is req
        self.requests[req.request_id] = req
        self._by_seed[req.seed] = req
        return req

    def add(self, req: Request) -> Request:
        self.track(req)
        self.sched.add(req)
        return req

    def step(self, stop_check: StopCheck | None = None) -> list[Request]:
        """One engine step, as engine.py's: plan and execute, then apply the oldest results
        (planning a window ahead, lookahead 2, the newest plan stays in flight while the one
        before it is applied); with nothing left, flush the bookkeeping."""
        plan = self.sched.schedule()
        seqs = [r.arrival_seq for r in self.sched.waiting]
        assert seqs == sorted(seqs), "the waiting queue left arrival order"
        if plan is not None:
            self.launched.append((plan, self.execute(plan)))
        keep = 1 if self.sched.lookahead == 2 and plan is not None else 0
        got: list[Request] = []
        while len(self.launched) > keep:
            done, result = self.launched.popleft()
            got += self.sched.update(done, result, stop_check)
        if not self.sched.has_unfinished():
            self.flush()
        return got

    def flush(self) -> None:
        idle = self.sched.bookkeeping_plan()
        if idle is not None:
            assert not idle.has_work and idle.decode_traversals == 0
            self.execute(idle)

    def drain(self, max_steps: int = 5_000, stop_check: StopCheck | None = None) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                self.flush()
                return
            self.step(stop_check)
        raise AssertionError("the scheduler did not drain")

    # -- the oracle --------------------------------------------------------------------
    def expected_exit_loop(self, rid: str, pos: int) -> int:
        """0-based loop after which the token at `pos` exits, from the fp32 rule."""
        req = self.requests[rid]
        if pos < req.prompt_len:
            return self.depth - 1  # prompt tokens always run full depth
        tracker = ExitTracker(req.controls)
        while not tracker.step(self.hazard(rid, tracker.loops_done, pos)):
            pass
        return tracker.loops_done - 1

    def swap_outs(self) -> list[SwapOut]:
        return [s for p in self.plans for s in p.swap_outs]

    def rows_of(self, plan_index: int) -> list[list[Row]]:
        start, end = self.windows[plan_index]
        return self.traversals[start:end]

    # -- the device ----------------------------------------------------------------------
    def _slot_of(self, table: list[int], pos: int, what: str) -> int:
        index = pos // self.bs
        assert index < len(table), (
            f"{what} position {pos} past the table end ({len(table)} blocks of {self.bs}): "
            "the scheduler did not reserve the window's blocks"
        )
        return table[index] * self.bs + pos % self.bs

    def _block_slots(self, blocks: tuple[int, ...]) -> list[int]:
        return [b * self.bs + o for b in blocks for o in range(self.bs)]

    def _key(self, req: Request, pos: int, version: int) -> tuple:
        if pos < req.prompt_len:  # by content: valid for every request with this prefix
            return ("prompt", tuple(req.prompt_token_ids[: pos + 1]), version)
        return (req.request_id, pos, version)

    def _final(self, req: Request, pos: int) -> int:
        if pos < req.prompt_len:
            return self.depth - 1
        return self.exit_loop[(req.request_id, pos)]

    def _write(self, s: FakeSlot, plane: int, pos: int, loop: int) -> None:
        req = s.req
        assert not req.finished, f"{req.request_id} wrote KV after it finished"
        assert pos < req.max_positions, f"{req.request_id} wrote position {pos} (never run)"
        self.kv[self._slot_of(s.tables[plane], pos, "write of")] = self._key(req, pos, loop)

    def _check_reads(self, s: FakeSlot, plane: int, query: int, loop: int) -> None:
        """The query at `query` (loop `loop`) attends to every position up to itself."""
        req, table = s.req, s.tables[plane]
        for q in range(query + 1):
            if q == query:
                version = loop  # itself, just written
            else:
                final = self._final(req, q)
                version = final if self.shared else min(loop, final)
            got = self.kv.get(self._slot_of(table, q, "read of"))
            want = self._key(req, q, version)
            assert got == want, (
                f"{req.request_id} at loop {loop}, position {query} reads position {q} on "
                f"plane {plane}: it holds {got}, expected {want}"
            )

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        sched = self.sched
        assert plan.decode_traversals <= self.window, "a window longer than the device's"
        assert plan.num_prefill_tokens <= sched.config.max_num_batched_tokens
        self._apply_diffs(plan)
        self._check_mirror()
        if self.check_reservation:
            self._check_reservation(plan)
        events: list[TokenEvent] = []
        for wave in plan.prefill:
            events += self._prefill(wave)
        if plan.decode_traversals == 0 and sched.lookahead == 1:
            # (planning a window ahead, a plan may end at its first tokens; the next has the
            # window, planned before these results are seen)
            assert not any(s.active for s in self.slots.values()), "decode stalled"
        start = len(self.traversals)
        self._keys = plan.decode_keys
        for _ in range(plan.decode_traversals):
            events += self._traversal()
        self.windows.append((start, len(self.traversals)))
        for s in self.slots.values():
            self.tables_seen[s.req.request_id] = [list(t) for t in s.tables]
        result = StepResult(tuple(events))
        self.results.append(result)
        return result

    def _apply_diffs(self, plan: StepPlan) -> None:
        for out in plan.swap_outs:
            assert out.snapshot not in self.snapshots
            s = self.slots.pop(out.slot)
            assert out.blocks == tuple(b for t in s.tables for b in t), "snapshot != its tables"
            self.snapshots[out.snapshot] = _Snapshot(
                _copy_slot(s),
                [self.kv.get(k) for k in self._block_slots(out.blocks)],
                [len(t) for t in s.tables],
            )
        for slot in plan.slot_frees:
            assert slot in self.slots, f"free of slot {slot}, which holds nothing"
            del self.slots[slot]
        for snapshot in plan.snapshot_drops:
            del self.snapshots[snapshot]
        for init in plan.slot_inits:
            assert init.slot not in self.slots, "a slot was initialised while still in use"
            req = self._by_seed[init.seed]
            assert init.params == req.params and init.controls == req.controls
            assert init.stop_token_ids == tuple(sorted(req.stop_token_ids))
            assert init.prompt_len == req.prompt_len
            assert len(init.block_tables) == self.sched.blocks.num_planes
            self.slots[init.slot] = FakeSlot(req, [list(t) for t in init.block_tables])
        for swap_in in plan.swap_ins:
            snap = self.snapshots.pop(swap_in.snapshot)
            assert swap_in.slot not in self.slots, "resumed into a slot still in use"
            assert [len(t) for t in swap_in.block_tables] == snap.lengths, "a different size"
            for k, entry in zip(self._block_slots(swap_in.blocks), snap.kv, strict=True):
                if entry is None:
                    self.kv.pop(k, None)
                else:
                    self.kv[k] = entry
            state = _copy_slot(snap.state)
            state.tables = [list(t) for t in swap_in.block_tables]
            self.slots[swap_in.slot] = state
        for append in plan.block_appends:
            s = self.slots[append.slot]
            assert len(append.blocks) == len(s.tables), "every plane grows together"
            assert len({len(b) for b in append.blocks}) == 1 and append.blocks[0], append
            for table, new in zip(s.tables, append.blocks, strict=True):
                table.extend(new)

    def _check_mirror(self) -> None:
        """After the diffs: the slots are exactly the running requests', tables included."""
        running = {r.slot: r for r in self.sched.running}
        assert set(self.slots) == set(running), (sorted(self.slots), sorted(running))
        for slot, s in self.slots.items():
            req = running[slot]
            assert s.req is req, f"slot {slot} holds {s.req.request_id}, not {req.request_id}"
            assert s.tables == req.block_tables, f"{req.request_id}: mirror != tables"

    def _check_reservation(self, plan: StepPlan) -> None:
        """Every block a window may touch is reserved before it runs."""
        n, bs = plan.decode_traversals, self.bs
        last = {c.slot for wave in plan.prefill for c in wave if c.last}
        for req in self.sched.running:
            if req.stage is Stage.DECODE:
                reach = min(req.decode_position + n, req.max_positions)
            elif req.slot in last:
                reach = min(req.prompt_len + n, req.max_positions)
            else:
                continue
            assert len(req.block_tables[0]) * bs >= reach, (req.request_id, reach)

    def _prefill(self, wave: tuple[PrefillChunk, ...]) -> list[TokenEvent]:
        assert wave and len({c.slot for c in wave}) == len(wave), "one chunk per request"
        for c in wave:
            s = self.slots[c.slot]
            req = s.req
            assert c.request_id == req.request_id, "a chunk for another request's slot"
            assert not s.active and s.token is None, "prefill of a decoding slot"
            end = c.start + len(c.token_ids)
            if s.prefilled is None:  # the first chunk: after the cached prefix, if any
                assert c.start % self.bs == 0 and c.start < req.prompt_len
                assert c.start == 0 or self.sched.blocks.prefix_caching
            else:
                assert c.start == s.prefilled, "chunks out of order"
            assert c.token_ids == tuple(req.prompt_token_ids[c.start : end]) and c.token_ids
            assert c.last == (end == req.prompt_len)
        for loop in range(self.depth):  # the wave is one batch per loop
            plane = 0 if self.shared else loop
            for c in wave:
                s = self.slots[c.slot]
                positions = range(c.start, c.start + len(c.token_ids))
                for pos in positions:
                    self._write(s, plane, pos, loop)
                for pos in positions:
                    self._check_reads(s, plane, pos, loop)
        events = []
        for c in wave:
            s = self.slots[c.slot]
            s.prefilled = c.start + len(c.token_ids)
            if c.last:
                token = token_for(c.request_id, s.req.prompt_len - 1)
                events.append(TokenEvent(c.slot, Sample(token), self.depth))
                s.token, s.position, s.loop, s.generated = token, s.req.prompt_len, 0, 1
                s.tracker = ExitTracker(s.req.controls)
                s.active = not self._finishes(s)
                s.parked = not self.refill
        return events

    def _finishes(self, s: FakeSlot) -> bool:
        """The device's rule for deactivating a slot."""
        return s.token in s.req.stop_token_ids or s.generated >= s.req.params.max_tokens

    def _traversal(self) -> list[TokenEvent]:
        if not self.refill and all(s.parked or not s.active for s in self.slots.values()):
            for s in self.slots.values():  # the cohort starts together
                s.parked = False
        rows, events = [], []
        for index in sorted(self.slots):
            s = self.slots[index]
            if not s.active or s.parked:
                continue
            req, pos, loop = s.req, s.position, s.loop
            rid = req.request_id
            if loop == 0:
                assert s.token == token_for(rid, pos - 1), "embeds the wrong token"
            plane = 0 if self.shared else loop
            self._write(s, plane, pos, loop)
            self._check_reads(s, plane, pos, loop)
            assert pos + 1 <= self._keys, (
                f"{rid} attends to {pos + 1} keys, the plan said {self._keys}"
            )
            rows.append(Row(rid, loop, pos))
            assert s.tracker is not None
            if not s.tracker.step(self.hazard(rid, loop, pos)):
                s.loop += 1
                continue
            self.exit_loop[(rid, pos)] = loop
            if self.exit_copies and not self.shared:  # version `loop` into every deeper plane
                src = self.kv[self._slot_of(s.tables[loop], pos, "copy of")]
                for deeper in range(loop + 1, self.depth):
                    self.kv[self._slot_of(s.tables[deeper], pos, "copy of")] = src
            token = token_for(rid, pos)
            events.append(TokenEvent(index, Sample(token), loop + 1))
            s.token, s.position, s.loop = token, pos + 1, 0
            s.generated += 1
            s.tracker = ExitTracker(req.controls)
            if self._finishes(s):
                s.active = False
            if not self.refill:
                s.parked = True
        self.traversals.append(rows)
        return events


def _copy_slot(s: FakeSlot) -> FakeSlot:
    clone = copy.copy(s)
    clone.tables = [list(t) for t in s.tables]
    clone.tracker = copy.copy(s.tracker)
    return clone


def drain(worker: FakeWorker, max_steps: int = 5_000) -> None:
    worker.drain(max_steps)


def expected_outputs(worker: FakeWorker, req: Request) -> tuple[list[int], list[int]]:
    """Serial semantics: first token from full-depth prefill, then one exit per position."""
    tokens, depths = [], []
    pos = req.prompt_len - 1
    while True:
        tokens.append(token_for(req.request_id, pos))
        depths.append(worker.expected_exit_loop(req.request_id, pos) + 1)
        if tokens[-1] in req.stop_token_ids or len(tokens) >= req.params.max_tokens:
            return tokens, depths
        pos += 1


def check_outputs(worker: FakeWorker, reqs: list[Request]) -> None:
    for req in reqs:
        assert req.finish_reason in ("length", "stop"), (req.request_id, req.finish_reason)
        assert (req.output_token_ids, req.exit_depths) == expected_outputs(worker, req), (
            req.request_id
        )


def assert_clean(worker: FakeWorker) -> None:
    """Nothing held anywhere: blocks, slots (sorted free slots == range), snapshots."""
    sched = worker.sched
    assert sched.blocks.num_used == 0
    assert not sched.has_unfinished()
    assert not sched.has_pending_ops()
    assert sorted(sched._free_slots) == list(range(sched.config.max_num_seqs))
    assert worker.slots == {} and worker.snapshots == {}
