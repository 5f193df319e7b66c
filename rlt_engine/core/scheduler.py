"""Loop-level continuous batching, planned one window at a time.

Decode belongs to the device: every decoding request sits in a slot of the worker's persistent
batch, and one step runs `decode_window` traversals of the shared stack over all of them. A
row's loop, its exit (the fp32 rule of `exit_rule.py`), lm_head, sampling and the next token's
embedding happen there, so rows at different depths share every traversal and nothing waits
for the host between loops.
- refill: a token that exits is sampled in the same traversal and its successor enters loop 0
  in the next one.
- no-refill: an exited slot waits (on the device) until every decoding slot has exited.
The host plans prefill (chunks through every loop, in queue order within a token budget),
admission, growth and preemption, and learns each new token from the step's events.
Memory and queue policies (admission, growth, priority, preemption) live in `admission.py`.

KV for a window is reserved before it runs: a window of N traversals advances a slot by at
most N positions (every token takes at least one traversal), so each decoding request's tables
cover its current position + N (capped at its last position) before the plan leaves.

Asynchronous scheduling (`lookahead=2`): the next plan is built while the previous one still
runs, so the host's view lags by one window. Each plan in flight keeps its own context — which
request owned each slot when it was planned, its prefill chunks, the requests it touches — and
results are matched through that context, never through a request's current slot (slots and
ids are reused; a request preempted meanwhile still owns the events its old slot produced,
which its snapshot already includes). Reservations cover two windows past the host's view.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rlt_engine.config import CacheConfig, SchedulerConfig
from rlt_engine.core.admission import Admission
from rlt_engine.core.block_manager import BlockManager
from rlt_engine.core.plan import (
    BlockAppend,
    MaskUpdate,
    PrefillChunk,
    Sample,
    Stage,
    StepPlan,
    StepResult,
)
from rlt_engine.core.request import Request

StopCheck = Callable[[Request], bool]  # called after each accepted token; True = stop now


@dataclass(eq=False)
class _PlanContext:
    """What the scheduler must remember about one plan until its results are applied."""

    plan: StepPlan
    owners: dict[int, Request]  # slot -> the request that owned it when this plan was made
    chunks: list[tuple[Request, PrefillChunk]]
    touched: list[Request]  # requests whose device state this plan changes
    # preemption count of each chunk's request at planning: a prefix written by this plan is
    # committed only if its request kept the blocks (was not preempted while it ran)
    epochs: dict[int, int] = field(default_factory=dict)
    # the decode rows of this plan's window, each with the traversals it decodes in
    ran: list[tuple[Request, int]] = field(default_factory=list)


class Scheduler(Admission):
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        depth: int,
        cache: CacheConfig | None = None,
        decode_window: int = 1,
        lookahead: int = 1,
        ride_waves: bool = True,
        max_ride_rows: int | None = None,
    ) -> None:
        """`ride_waves`: let a prefill wave run inside the first `depth` traversals of a decode
        window (worker/decode.py's RidingWave) instead of before it (False: the comparison).
        `max_ride_rows`: the largest wave that rides (the worker's largest captured wave
        shape; a larger one would ride eagerly, launch by launch); None: no bound of its own."""
        super().__init__(config, cache or CacheConfig(), blocks, depth)
        self.ride_waves, self.max_ride_rows = ride_waves, max_ride_rows
        if lookahead not in (1, 2):
            raise ValueError(
                f"lookahead must be 1 (synchronous) or 2 (asynchronous), got {lookahead}"
            )
        self.decode_window, self.lookahead = decode_window, lookahead
        self.trace: list[StepPlan] | None = None  # set to [] to record every plan
        self._chunks: list[tuple[Request, PrefillChunk]] = []  # prefill of the plan being built
        self._in_flight: deque[_PlanContext] = deque()  # planned, results not applied yet
        self._window_deferred = False  # the last plan ended at its first tokens

    # -- planning ------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next plan (None: no work). With lookahead 2 it may be built while the previous
        plan runs; `update` must then be called for the plans in the order they were made."""
        if len(self._in_flight) >= self.lookahead:
            raise RuntimeError("apply the results of the plans in flight before planning more")
        ran = self._ran_in_flight()  # the windows in flight: what each row decodes in them
        self._retire(ran)
        self.admit()
        if self._in_flight and self.running and all(self._waits_for_mask(r) for r in self.running):
            # every row's next token needs the mask of the token in flight: a window planned
            # now would run them all held. See the results first (synchronous, in effect)
            return None
        planned: list[Request] = []
        window = self.decode_window
        reach = window * self.lookahead  # traversals that may run before the next plan's view
        for req in sorted(self.running, key=self.rank):  # best first: growth preempts the worst
            if req.stage is not Stage.DECODE or req.snapshot is not None:
                continue
            if req in self.running and self.ensure_capacity(
                req, self._window_end(req, reach), planned=planned
            ):
                planned.append(req)
        waves = self._prefill_waves(planned, reach)
        # a last chunk starts decoding unless its first token is also its last; so does a
        # prompt whose last chunk is still in flight (its first token not seen yet)
        decoding = (
            any(r.stage is Stage.DECODE for r in planned)
            or any(c.last and r.params.max_tokens > 1 for r, c in self._chunks)
            or any(self._first_token_in_flight(r) for r in self.running)
        )
        if not (waves or decoding):
            return None  # pending bookkeeping rides with the next plan (or the idle flush)
        # One wave and a window at least `depth` long: the wave rides the window's first
        # traversals, its rows sharing their weight reads (no pass of its own per loop). Not
        # with no-refill cohorts (a slot would join mid-cohort), several waves (a later wave
        # needs the earlier one's every loop first), or where the traversal would exceed
        # max_num_batched_tokens rows (a wave that large amortises its weight reads anyway).
        # Asynchronous, a wave with no other rows decoding beside it has no reads to share:
        # it ends its plan at its first tokens instead (below), for time to first token.
        # Nor a wave past `max_ride_rows`: it runs on its own, in captured pieces.
        span = max((r.slot + 1 for r in self.running if r.slot is not None), default=0)
        wave_rows = sum(len(c.token_ids) for c in waves[0]) if len(waves) == 1 else 0
        rides = (
            self.ride_waves
            and self.config.refill
            and not any(c.logprob_targets for _, c in self._chunks)  # scored on the prefill path
            and decoding
            and (self.lookahead == 1 or self._others_decode(planned))
            and len(waves) == 1
            and window >= self.depth
            and span + wave_rows <= self.config.max_num_batched_tokens
            and (self.max_ride_rows is None or wave_rows <= self.max_ride_rows)
        )
        # Asynchronous: a plan that samples first tokens ends with them, so they are read back
        # without waiting for a decode window (time to first token); the window follows in
        # the next plan, which is launched before this one is collected (no idle GPU). Never
        # twice in a row: under a stream of arrivals the running requests must still decode.
        defer = (
            self.lookahead == 2
            and not rides
            and not self._window_deferred
            and any(c.last for _, c in self._chunks)
        )
        self._window_deferred = defer and decoding
        traversals = window if decoding and not defer else 0
        # Asynchronous, a window that a wave rides ends at the wave's first tokens (its
        # `depth`th traversal) for the same reason: they are read back without waiting out the
        # rest of the window, and the next plan, already launched, carries the decode on.
        if rides and self.lookahead == 2:
            traversals = self.depth
        if traversals and self.config.refill:
            traversals = self._traversals_needed(traversals, rides, ran)
            if not (traversals or waves):
                return None  # every row ends in the windows in flight: see their results first
        if traversals and self.running and all(r.constrained for r in self.running):
            # each row emits at most one token a window (then waits for its next mask): a
            # window no longer than a token's loops wastes no traversal on held rows
            longest = max(r.controls.max_loops for r in self.running)
            traversals = min(traversals, max(longest, self.depth if rides else 0))
        plan = self._finish_plan(waves, traversals, planned, rides=rides)
        if self.trace is not None:
            self.trace.append(plan)
        return plan

    def _waits_for_mask(self, req: Request) -> bool:
        """A constrained row decoding or about to (its first token in flight): it emits at
        most one token a window, then waits for the next mask."""
        decoding = req.stage is Stage.DECODE and req.snapshot is None
        return req.constrained and (decoding or self._first_token_in_flight(req))

    def _others_decode(self, planned: list[Request]) -> bool:
        """Whether the window has decode rows besides the slots this plan's wave starts."""
        starting = {id(r) for r, _ in self._chunks}
        return any(r.stage is Stage.DECODE for r in planned) or any(
            self._first_token_in_flight(r) and id(r) not in starting for r in self.running
        )

    def _retire(self, ran: dict[int, int]) -> None:
        """Asynchronous, with requests queued: a row certain to reach max_tokens within the
        windows in flight gives its slot and blocks back now, so a queued request takes them
        in this plan instead of one window later. Safe on the device: the plans in flight run
        before this one on the same stream, so the slot is cleared, re-initialised and its
        blocks rewritten only after the row's last traversal. The row's remaining events come
        back through the owners of their own plans; applying them finishes it."""
        if not (self.lookahead == 2 and self.config.refill and self._in_flight):
            return
        if not (self.waiting or self.swapped):
            return  # nobody would take the slot: keep the row until its results are in
        for req in list(self.running):
            # (a constrained row may wait for its masks: never certain to end in time)
            certain = req.stage is Stage.DECODE and req.snapshot is None and not req.constrained
            if certain and self._traversals_left(req, ran) <= 0:
                self.release(req)
                req.slot, req.block_tables = None, None  # both may belong to others now
                self.retiring.append(req)

    def _ran_in_flight(self) -> dict[int, int]:
        """Traversals each row decodes in within the plans in flight (by id of request)."""
        ran: dict[int, int] = {}
        for ctx in self._in_flight:
            for req, traversals in ctx.ran:
                ran[id(req)] = ran.get(id(req), 0) + traversals
        return ran

    def _traversals_left(self, req: Request, ran: dict[int, int], late: int = 0) -> int:
        """The most traversals decode row `req` may still need beyond the windows in flight
        (`late`: traversals before it starts decoding); see `_traversals_needed`. A
        constrained row may also wait up to two windows for each token's mask (it runs again
        in the plan after the one that sees its token): its windows are never cut."""
        if req.constrained:
            left = req.params.max_tokens - len(req.output_token_ids)
            return late + left * (req.controls.max_loops + 2 * self.decode_window)
        if req.stage is Stage.DECODE:
            left = req.params.max_tokens - len(req.output_token_ids)
            into = req.decode_traversals - req.decode_loops  # loops into the current token
        else:  # its first token is sampled now or in flight
            left, into = req.params.max_tokens - 1, 0
        return late + left * req.controls.max_loops - into - ran.get(id(req), 0)

    def _traversals_needed(self, window: int, rides: bool, ran: dict[int, int]) -> int:
        """The window cut to the most traversals any of its rows may still run, so that no
        traversal runs after every row has finished (the windows in flight included). Each
        token takes at most its request's max_loops traversals: a decode row needs at most
        (tokens left) x max_loops, less the loops it is into its current token and the
        traversals it runs in the windows in flight; a row starting now or in flight at most
        (max_tokens - 1) x max_loops, after the wave's depth traversals if it rides. An upper
        bound (an early exit or a stop id only ends a row sooner); with refill only, where a
        running row advances one loop every traversal. `ran`: `_ran_in_flight()`."""
        starting = {id(r) for r, c in self._chunks if c.last}
        need = self.depth if rides else 0
        for req in self.running:  # every running slot is a row of the window, planned or not
            if req.snapshot is not None:
                continue
            if not (
                req.stage is Stage.DECODE or id(req) in starting or self._first_token_in_flight(req)
            ):
                continue
            late = self.depth if rides and id(req) in starting else 0
            need = max(need, self._traversals_left(req, ran, late))
        return min(window, need)

    @staticmethod
    def _first_token_in_flight(req: Request) -> bool:
        return (
            req.stage is Stage.PREFILL
            and req.num_prefilled == req.prompt_len
            and req.snapshot is None
            and req.params.max_tokens > 1
        )

    def bookkeeping_plan(self) -> StepPlan | None:
        """A plan without work carrying pending worker operations (slot frees, snapshot
        drops, ...) for when no further step will run. It produces no results to apply."""
        if not self.has_pending_ops():
            return None
        return self._finish_plan((), 0, [], register=False)

    @property
    def plans_in_flight(self) -> int:
        return len(self._in_flight)

    def _decode_keys(self, decoding: list[Request]) -> int:
        """The most keys a row of this plan's window may attend to: its newest token's
        position as known here plus every traversal that may run before the plan after this
        one is built (the windows in flight and this one, `_window_end`'s reach), each moving
        a row at most one position on; never past the request's last position. `_window_end`
        inlined: through it and `decode_position` 256 rows took 0.5 ms a plan here."""
        reach = self.decode_window * self.lookahead
        keys = 0
        for r in decoding:
            # the newest sampled token sits at prompt_len + outputs - 1; a first token in
            # flight or sampled now (no output seen yet) at prompt_len
            ahead = len(r.output_token_ids) + reach - 1 if r.output_token_ids else reach
            last = r.params.max_tokens - 1
            end = r.prompt_len + (ahead if ahead < last else last)
            if end > keys:
                keys = end
        return keys

    @staticmethod
    def _window_end(req: Request, window: int, position: int | None = None) -> int:
        """KV positions a request may need by the end of a window of `window` traversals
        whose in-flight token sits at `position` (default: its current one)."""
        position = req.decode_position if position is None else position
        return min(position + window, req.max_positions)

    def _prefill_waves(
        self, planned: list[Request], window: int
    ) -> tuple[tuple[PrefillChunk, ...], ...]:
        """Chunks in rank order within the token budget. LAST_EXITED: one chunk per request.
        SHARED: a position must finish every loop before the next one reads it, so a request
        advances one token per wave (several waves per step)."""
        budget = self.config.max_num_batched_tokens
        per_request: list[list[PrefillChunk]] = []
        for req in sorted(self.running, key=self.rank):
            if req.stage is not Stage.PREFILL or req.snapshot is not None or budget <= 0:
                continue
            if req not in self.running:
                continue  # preempted while this plan was being built
            remaining = req.prompt_len - req.num_prefilled
            if remaining == 0:
                continue  # its last chunk is in flight (async scheduling): nothing left to plan
            size = min(self.config.prefill_chunk_size, remaining, budget)
            end = req.num_prefilled + size
            # the last chunk's slot decodes in this very window (its first token at prompt_len)
            need = self._window_end(req, window, req.prompt_len) if end == req.prompt_len else end
            if not self.ensure_capacity(req, need, planned=planned):
                continue
            step = 1 if self.shared else size
            scored = req.params.prompt_logprobs is not None
            chunks = [
                PrefillChunk(
                    req.request_id,
                    req.slot,  # type: ignore[arg-type]
                    start,
                    tuple(req.prompt_token_ids[start : start + step]),
                    last=start + step == req.prompt_len,
                    logprob_targets=(
                        tuple(req.prompt_token_ids[start + 1 : start + step + 1]) if scored else ()
                    ),
                )
                for start in range(req.num_prefilled, end, step)
            ]
            req.num_prefilled = end
            self._chunks.extend((req, c) for c in chunks)
            per_request.append(chunks)
            planned.append(req)
            budget -= size
        depth = max((len(c) for c in per_request), default=0)
        return tuple(tuple(c[i] for c in per_request if i < len(c)) for i in range(depth))

    def _finish_plan(
        self,
        waves: tuple[tuple[PrefillChunk, ...], ...],
        traversals: int,
        owners: list[Request],
        register: bool = True,
        rides: bool = False,
    ) -> StepPlan:
        # slots this plan creates (inits, resumes), with or without work for them this step
        started = {op.slot for op in (*self._slot_inits, *self._swap_ins)}
        decoding = (
            [r for r in self.running if r.stage is Stage.DECODE or self._first_token_in_flight(r)]
            if traversals
            else []
        )
        # Everyone whose device state this plan touches, in case the step fails.
        touched = [
            *owners,
            *decoding,
            *(r for r in self.running if r.slot in started),
            *self._preempted_since_plan,
            *(r for r, _ in self._chunks),
        ]
        slot_owner = {r.slot: r for r in self.running if r.slot is not None}
        plan = StepPlan(
            swap_outs=tuple(self._swap_outs),
            slot_frees=tuple(self._slot_frees),
            snapshot_drops=tuple(self._snapshot_drops),
            slot_inits=tuple(self._slot_inits),
            swap_ins=tuple(self._swap_ins),
            block_appends=self._block_appends(),
            mask_updates=self._mask_updates(),
            prefill=waves,
            decode_traversals=traversals,
            wave_rides=rides,
            decode_keys=self._decode_keys(decoding),
        )
        chunks, self._chunks = self._chunks, []
        if register:
            epochs = {id(r): r.num_preemptions for r, _ in chunks}
            ran = self._traversals_run(decoding, chunks, traversals, rides)
            self._in_flight.append(_PlanContext(plan, slot_owner, chunks, touched, epochs, ran))
        self.clear_pending_ops()
        return plan

    def _traversals_run(
        self,
        decoding: list[Request],
        chunks: list[tuple[Request, PrefillChunk]],
        traversals: int,
        rides: bool,
    ) -> list[tuple[Request, int]]:
        """The rows of this plan's window with the traversals each decodes in: all of them for
        a running decode row and for a slot its prefill started before the window; those
        after the wave's `depth` for a slot a riding wave starts. (With refill only: a parked
        row of a no-refill cohort waits.)"""
        if not self.config.refill:
            return []
        riding = {id(r) for r, c in chunks if c.last} if rides else set()
        return [
            (req, traversals - (self.depth if id(req) in riding else 0))
            for req in decoding
            if req.snapshot is None and req.params.max_tokens > 1
        ]

    def _mask_updates(self) -> tuple[MaskUpdate, ...]:
        """The masks the host computed since the last plan, for constrained rows in a slot (a
        preempted request keeps its mask until it resumes: after its SwapIn)."""
        updates = []
        for req in self.running:
            if req.token_mask and req.slot is not None:
                updates.append(MaskUpdate(req.slot, req.token_mask))
                req.token_mask = b""
        return tuple(updates)

    def _block_appends(self) -> tuple[BlockAppend, ...]:
        """Blocks grown since the worker last heard about each running request's tables."""
        appends = []
        for req in self.running:
            tables = req.block_tables
            if tables is None or len(tables[0]) == req.blocks_sent:
                continue
            appends.append(
                BlockAppend(req.slot, tuple(tuple(t[req.blocks_sent :]) for t in tables))  # type: ignore[arg-type]
            )
            req.blocks_sent = len(tables[0])
        return tuple(appends)

    def fail_plan(self) -> list[Request]:
        """The worker raised while executing the plans in flight: their effects on device state
        are unknown, so every request they touched is aborted (and nothing else is)."""
        contexts, self._in_flight = list(self._in_flight), deque()
        failed: list[Request] = []
        for ctx in contexts:
            for req in ctx.touched:
                if not req.finished and req not in failed:
                    self.finish(req, "abort")
                    failed.append(req)
        return failed

    # -- results -------------------------------------------------------------------------
    def update(
        self, plan: StepPlan, result: StepResult, stop_check: StopCheck | None = None
    ) -> list[Request]:
        """Apply the events of the oldest plan in flight (`plan`). Returns the requests that
        received tokens, in the order of their first event. `stop_check` sees every accepted
        token (stop strings)."""
        if not self._in_flight or self._in_flight[0].plan is not plan:
            raise RuntimeError("results must be applied in the order the plans were made")
        ctx = self._in_flight.popleft()
        for req, traversals in ctx.ran:
            req.decode_traversals += traversals
        for req, chunk in ctx.chunks:
            kept = req in self.running and ctx.epochs[id(req)] == req.num_preemptions
            if not req.finished and kept:
                end = chunk.start + len(chunk.token_ids)
                self.blocks.commit_prefix(req.request_id, req.prompt_token_ids, end)
        for scored in result.prompt_logprobs:
            req = ctx.owners.get(scored.slot)
            if req is not None and not req.finished:
                req.prompt_samples.extend(scored.samples)
        got_token: dict[str, Request] = {}
        for event in result.events:
            # the owner when the plan was made: it may have moved (preempted) since, and its
            # snapshot holds what this event reports; a finished owner's events are stale
            req = ctx.owners.get(event.slot)
            if req is None or req.finished:
                continue
            if req.stage is Stage.PREFILL:
                req.stage, req.first_token_time = Stage.DECODE, time.monotonic()
            self._accept_token(req, event.sample, event.exit_depth)
            got_token.setdefault(req.request_id, req)
            if stop_check is not None and stop_check(req):
                if req.finished:  # the stop string landed on its last allowed token
                    req.finish_reason = "stop"
                self.finish(req, "stop")
        if self.retiring and not self._in_flight:  # every retiring row ends in its plans
            stuck = ", ".join(r.request_id for r in self.retiring)
            raise RuntimeError(f"requests handed on early did not end in their windows: {stuck}")
        return list(got_token.values())

    def _accept_token(self, req: Request, sample: Sample, depth: int) -> None:
        """The same rule the device applies to deactivate a slot."""
        req.output_token_ids.append(sample.token_id)
        req.exit_depths.append(depth)
        if len(req.output_token_ids) > 1:  # a decode token (the first comes from the prefill)
            req.decode_loops += depth
        req.samples.append(sample)
        if sample.token_id in req.stop_token_ids:
            self.finish(req, "stop")
        elif len(req.output_token_ids) >= req.params.max_tokens:
            self.finish(req, "length")
