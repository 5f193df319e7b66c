"""Queues and memory policy: who runs, who waits, who is preempted.

- Admission takes candidates in rank order (FCFS: arrival; priority: lower `priority` value
  first, arrival breaks ties) and never lets a later candidate overtake one that does not fit.
  Under priority, a waiting request overtaken `max_bypass` times is promoted to the front, so
  long or low-priority requests cannot starve forever. Neither policy scans the queue per
  admission: FCFS reads its head, priority a heap and the overtake counts (`overtakes.py`).
- Growth (`incremental_kv`, the default): admission allocates a request's prompt and its
  tables grow as it advances. Without preemption, admission accounts for the growth every
  admitted request may still need, so growth never fails. Reservation (`incremental_kv` off):
  a request reserves KV for its whole lifetime at admission.
- Preemption (`enable_preemption`, the default) snapshots a request's pages of every plane and
  its device state to host memory and frees them; resuming restores them exactly into new
  pages (no recompute). It runs on memory pressure during growth (the worst-ranked request
  goes) and, under priority, when a candidate outranks running requests of strictly lower
  priority.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time

from rlt_engine.config import CacheConfig, KVLayout, SchedulerConfig
from rlt_engine.core.block_manager import BlockManager
from rlt_engine.core.overtakes import Overtakes
from rlt_engine.core.plan import SlotInit, Stage, SwapIn, SwapOut
from rlt_engine.core.request import Request

# the overtake counts' tree is rebased once it spans this many arrivals (see _count_bypass)
REBASE_SPAN = 4096


class Admission:
    def __init__(
        self, config: SchedulerConfig, cache: CacheConfig, blocks: BlockManager, depth: int
    ) -> None:
        self.config, self.cache, self.blocks, self.depth = config, cache, blocks, depth
        self.shared = cache.kv_layout is KVLayout.SHARED
        self.waiting: list[Request] = []  # in arrival order (`_best_queued` relies on it)
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        # certain to end within the plans in flight; their slots and blocks already given back
        # (Scheduler._retire), their last events still to come
        self.retiring: list[Request] = []
        # a heap: the lowest free slot first, so the device batch stays dense at the front
        self._free_slots = list(range(config.max_num_seqs))
        self._arrivals = itertools.count()
        self._snapshots = itertools.count()
        # priority: the waiting requests by (priority, arrival), stale entries skipped when
        # they surface; the admissions that count as overtakes; the waiting requests that went
        # back to the queue (their counts are not the arrival order's, see `_best_queued`)
        self.priority = config.scheduling_policy == "priority"
        self._by_priority: list[tuple[int, int, int, Request]] = []
        self._pushes = itertools.count()
        self._overtakes = Overtakes()
        self._requeued: dict[int, Request] = {}
        self.num_preemptions = 0
        self.clear_pending_ops()

    # -- worker bookkeeping carried by the next plan ------------------------------------
    def clear_pending_ops(self) -> None:
        self._slot_inits: list[SlotInit] = []
        self._slot_frees: list[int] = []
        self._swap_outs: list[SwapOut] = []
        self._swap_ins: list[SwapIn] = []
        self._snapshot_drops: list[int] = []
        self._preempted_since_plan: list[Request] = []

    def has_pending_ops(self) -> bool:
        return bool(
            self._slot_inits
            or self._slot_frees
            or self._swap_outs
            or self._swap_ins
            or self._snapshot_drops
        )

    # -- arrivals and departures -------------------------------------------------------
    def add(self, request: Request) -> None:
        if not self.blocks.can_ever_fit(request.max_positions):
            raise ValueError(
                f"request {request.request_id} needs "
                f"{self.blocks.blocks_needed(request.max_positions)} KV blocks for "
                f"{request.max_positions} positions but the pool has only "
                f"{self.blocks.num_blocks}; shorten the prompt or max_tokens, or enlarge the cache"
            )
        request.arrival_seq = next(self._arrivals)
        self.waiting.append(request)
        self._queued(request)

    def abort(self, request_id: str) -> Request | None:
        for req in (*self.waiting, *self.running, *self.swapped, *self.retiring):
            if req.request_id == request_id:
                self.finish(req, "abort")
                return req
        return None

    def finish(self, req: Request, reason: str) -> None:
        if req.finished:
            return
        self._dequeued(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.swapped:
            self.swapped.remove(req)
            self._snapshot_drops.append(req.snapshot)  # type: ignore[arg-type]
        if req in self.running:
            self.release(req)
        if req in self.retiring:
            self.retiring.remove(req)
        req.stage, req.finish_reason, req.finish_time = Stage.FINISHED, reason, time.monotonic()
        req.block_tables, req.slot, req.snapshot = None, None, None

    def release(self, req: Request) -> None:
        """Take a running request off the batch: its blocks and slot are free again."""
        self.running.remove(req)
        self.blocks.free(req.request_id)
        self._slot_frees.append(req.slot)  # type: ignore[arg-type]
        heapq.heappush(self._free_slots, req.slot)  # type: ignore[arg-type]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.retiring)

    # -- ordering ------------------------------------------------------------------------
    def rank(self, req: Request) -> tuple[float, int]:
        if not self.priority:
            return (0, req.arrival_seq)
        return (float("-inf") if self._promoted(req) else req.params.priority, req.arrival_seq)

    def _promoted(self, req: Request) -> bool:
        return self._bypassed(req) >= self.config.max_bypass

    def _bypassed(self, req: Request) -> int:
        """Times a later arrival was admitted first: counted while it was queued (waiting or
        preempted), frozen while it runs."""
        if req.bypass_mark is None:
            return req.bypassed
        return req.bypassed + self._overtakes.later(req.arrival_seq) - req.bypass_mark

    def _queued(self, req: Request) -> None:
        """`req` joined the queue (arrived, went back unstarted, or was preempted)."""
        if not self.priority:
            return
        req.bypass_mark = self._overtakes.later(req.arrival_seq)
        if req.snapshot is None:
            heapq.heappush(self._by_priority, self._heap_entry(req))

    def _dequeued(self, req: Request) -> None:
        """`req` left the queue (admitted, resumed or finished): its count freezes."""
        req.bypassed, req.bypass_mark = self._bypassed(req), None
        self._requeued.pop(id(req), None)

    def _heap_entry(self, req: Request) -> tuple[int, int, int, Request]:
        return (req.params.priority, req.arrival_seq, next(self._pushes), req)

    # -- admission -----------------------------------------------------------------------
    def admit(self) -> None:
        while self.waiting or self.swapped:
            cand = self._best_queued()
            if self._try_admit(cand):
                continue
            if not self._preempt_for(cand):
                return  # nobody overtakes the best candidate

    def _try_admit(self, cand: Request) -> bool:
        if not self._free_slots:
            return False
        if cand.snapshot is not None:
            return self._resume(cand)
        incremental = self.cache.incremental_kv
        tokens = cand.prompt_len if incremental else cand.max_positions
        if incremental and not self.config.enable_preemption:
            # every admitted request must still be able to grow to its full length
            growth = sum(
                self.blocks.blocks_to_grow(r.request_id, r.max_positions) for r in self.running
            )
            if self.blocks.blocks_needed(cand.max_positions) + growth > self.blocks.num_free:
                return False
        elif incremental:
            # keep headroom for running requests to grow; a lone request needs none
            reserve = int(self.cache.watermark * self.blocks.num_blocks) if self.running else 0
            if self.blocks.blocks_needed(tokens) + reserve > self.blocks.num_free:
                return False
        # (prompt logprobs need every prompt position computed: no prefix-cache hit)
        hits_allowed = self.blocks.prefix_caching and cand.params.prompt_logprobs is None
        prompt = cand.prompt_token_ids if hits_allowed else None
        try:
            tables, cached = self.blocks.allocate(cand.request_id, tokens, prompt)
        except RuntimeError:
            return False
        self.waiting.remove(cand)
        self._count_bypass(cand)
        cand.block_tables, cand.slot = tables, heapq.heappop(self._free_slots)
        cand.stage, cand.num_prefilled = Stage.PREFILL, cached
        cand.blocks_sent = len(tables[0])
        self._slot_inits.append(
            SlotInit(
                cand.slot,
                cand.params,
                cand.seed,
                cand.controls,
                tuple(sorted(cand.stop_token_ids)),
                cand.prompt_len,
                _frozen(tables),
                tuple(cand.prompt_token_ids) if cand.params.repetition_penalty != 1.0 else (),
                cand.token_mask,
            )
        )
        cand.token_mask = b""  # sent
        self.running.append(cand)
        return True

    def _resume(self, req: Request) -> bool:
        if not self.blocks.can_allocate(req.snapshot_tokens):
            return False
        tables, _ = self.blocks.allocate(req.request_id, req.snapshot_tokens)
        req.block_tables, req.slot = tables, heapq.heappop(self._free_slots)
        req.blocks_sent = len(tables[0])
        self._swap_ins.append(SwapIn(req.snapshot, req.slot, _frozen(tables)))  # type: ignore[arg-type]
        req.snapshot = None
        self.swapped.remove(req)
        self._count_bypass(req)
        self.running.append(req)
        return True

    def _best_queued(self) -> Request:
        """The best-ranked waiting or preempted request, without a pass over the queue (one cost
        12-13 ms an admission with 10,000 queued, ~2 s to fill 256 slots).

        FCFS ranks by arrival alone: the head of `waiting` or an earlier preempted request.
        Priority: a promoted request goes first, the earliest such. A request that has waited
        since it arrived was overtaken by every admission of a later arrival since then, so
        among those the earliest has the highest count and is the only one to check; the few
        that went back to the queue (preempted, or requeued before they started) are checked
        one by one. With none promoted: the best (priority, arrival) of the waiting heap or a
        preempted request."""
        if not self.priority:
            return min((*self.swapped, *self.waiting[:1]), key=self.rank)
        returned = (*self.swapped, *self._requeued.values())
        first = next((r for r in self.waiting if id(r) not in self._requeued), None)
        promoted = [r for r in (*returned, *([first] if first else ())) if self._promoted(r)]
        if promoted:
            return min(promoted, key=lambda r: r.arrival_seq)
        top = self._waiting_top()
        return min((*self.swapped, *([top] if top else ())), key=self.rank)

    def _waiting_top(self) -> Request | None:
        """The waiting request of the best (priority, arrival); stale heap entries (admitted or
        finished since they were pushed) are dropped on the way."""
        heap = self._by_priority
        if len(heap) > 2 * len(self.waiting) + 64:  # mostly stale: rebuild from the queue
            heap[:] = [self._heap_entry(r) for r in self.waiting]
            heapq.heapify(heap)
        while heap and heap[0][3].stage is not Stage.WAITING:
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def _count_bypass(self, admitted: Request) -> None:
        """Everyone still queued (waiting or preempted) that arrived earlier was overtaken:
        counted by arrival (`Overtakes`), not per queued request. Under FCFS nobody is: each
        admission takes the earliest arrival."""
        if not self.priority:
            return
        self._dequeued(admitted)
        self._overtakes.admitted(admitted.arrival_seq)
        if self._overtakes.span > REBASE_SPAN:
            # forget arrivals older than every request that is or may again be queued, so the
            # tree spans the live arrivals, not the history (amortised: half the span at once)
            live = (admitted, *self.running, *self.swapped, *self.waiting[:1])
            oldest = min(r.arrival_seq for r in live)
            if oldest - self._overtakes.base > self._overtakes.span // 2:
                self._overtakes.forget_before(oldest)

    # -- preemption ----------------------------------------------------------------------
    def _preempt_for(self, cand: Request) -> bool:
        """Priority: make room for `cand` by preempting strictly lower-priority requests."""
        if not (self.config.enable_preemption and self.priority):
            return False
        # Only strictly lower *declared* priority. A request promoted by the bypass bound goes
        # first in the queue but preempts no peers, and is itself never preempted for priority
        # (else it could be swapped back out as soon as it resumes).
        victims = [
            r
            for r in self.running
            if r.params.priority > cand.params.priority and not self._promoted(r)
        ]
        if not victims:
            return False
        need = self.blocks.blocks_needed(
            cand.snapshot_tokens if cand.snapshot is not None else cand.max_positions
        )
        reclaimable = sum(len(t) for r in victims for t in self.blocks.owned_blocks(r.request_id))
        if need > self.blocks.num_free + reclaimable:
            return False
        self.preempt(max(victims, key=self.rank))
        return True

    def ensure_capacity(self, req: Request, positions: int, planned: list[Request]) -> bool:
        """Grow `req`'s tables to cover `positions` (incremental allocation), preempting the
        worst-ranked request not yet planned this step when memory runs out."""
        if not self.cache.incremental_kv:
            return True
        while not self.blocks.grow(req.request_id, positions):
            if not self.config.enable_preemption:
                raise RuntimeError("KV growth failed although admission reserved it")
            candidates = [r for r in self.running if r not in planned]
            victim = max(candidates, key=self.rank)
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def preempt(self, victim: Request) -> None:
        """Snapshot `victim` to host memory and free its pages and slot.

        A victim admitted or resumed while this same plan was being built has no device
        state yet: it simply goes back to where it came from, with nothing to copy."""
        capacity = self.blocks.capacity(victim.request_id)
        tables = self.blocks.owned_blocks(victim.request_id)
        pending_init = [i for i in self._slot_inits if i.slot == victim.slot]
        pending_in = [i for i in self._swap_ins if i.slot == victim.slot]
        self.blocks.free(victim.request_id)
        heapq.heappush(self._free_slots, victim.slot)  # type: ignore[arg-type]
        self.running.remove(victim)
        if pending_init:  # never ran: back to the queue, nothing to snapshot
            self._slot_inits.remove(pending_init[0])
            self._requeue_unstarted(victim)
            return
        victim.num_preemptions += 1
        self.num_preemptions += 1
        if pending_in:
            self._swap_ins.remove(pending_in[0])
            victim.snapshot = pending_in[0].snapshot  # still held by the worker, unchanged
        else:
            victim.snapshot, victim.snapshot_tokens = next(self._snapshots), capacity
            self._swap_outs.append(SwapOut(victim.snapshot, victim.slot, _flat(tables)))  # type: ignore[arg-type]
            self._preempted_since_plan.append(victim)  # the plan touches its device state
        victim.slot, victim.block_tables = None, None
        self.swapped.append(victim)
        self._queued(victim)

    def _requeue_unstarted(self, req: Request) -> None:
        req.stage, req.slot, req.block_tables = Stage.WAITING, None, None
        req.num_prefilled = 0
        bisect.insort(self.waiting, req, key=lambda r: r.arrival_seq)
        self._queued(req)
        if self.priority:
            self._requeued[id(req)] = req


def _flat(tables: list[list[int]]) -> tuple[int, ...]:
    return tuple(b for table in tables for b in table)


def _frozen(tables: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(table) for table in tables)
