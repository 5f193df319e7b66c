"""Executes `StepPlan`s against the persistent slot batch.

Order per step: bookkeeping diffs (swap-outs, frees, inits, swap-ins, block appends), prefill
waves (worker/prefill.py: host-planned chunks through every loop, a CUDA graph per wave shape
when graphs are on; a chunk that ends its prompt samples the first token and starts the slot
decoding), then the decode window: `decode_traversals`
traversals over slots [0, B), replayed from a CUDA graph per (padded B, flags) when graphs are
on. Everything the host learns comes back in one read at the end of the step.

`launch(plan)` enqueues all of that, including the read back into pinned host memory, and
returns at once; `collect(launched)` waits for it and decodes the events. `execute` is the two
back to back. Asynchronous scheduling launches plan n+1 before collecting plan n: the work runs
in order on one stream, so plan n+1's work never overtakes plan n's. Only the read back runs
on a stream of its own (CUDA), behind the plan's work: the next window's kernels follow the
last one at once instead of waiting behind a copy (a copy engine's hand-off to the next
kernel left the GPU idle ~10 us at each window boundary on the H200). Windows alternate
between the two halves of the event buffers, and a half is written again only after its
copy is done.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rlt_engine.config import ExecutionConfig
from rlt_engine.core.plan import (
    PrefillChunk,
    PromptLogprobs,
    Sample,
    StepPlan,
    StepResult,
    SwapIn,
    SwapOut,
    TokenEvent,
)
from rlt_engine.kernels import slot_step
from rlt_engine.kernels.paged_attention import LONG_CONTEXT
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.worker.attention import TritonPagedAttention, attention_backend
from rlt_engine.worker.batched_sampler import SampleOutput, SamplingTensors, sample
from rlt_engine.worker.decode import DecodeTraversal, EventBuffers, Flags, RidingWave
from rlt_engine.worker.graphs import CaptureTally, GraphCache
from rlt_engine.worker.prefill import (
    MAX_GRAPH_ROWS,
    PrefillRunner,
    WaveInputs,
    WaveLayout,
)
from rlt_engine.worker.slot_batch import SlotBatch, SlotHost, to_host, upload

MAX_LOGPROBS = 20


@dataclass
class _Snapshot:
    k: torch.Tensor  # [layers, slots of every owned block, kv_heads, head_dim]
    v: torch.Tensor
    slot: tuple[dict[str, torch.Tensor], SlotHost]


@dataclass
class _FirstTokens:
    slots: list[int]
    drawn: SampleOutput


@dataclass
class _Scored:
    """A chunk's prompt logprobs (PrefillChunk.logprob_targets), on the device until read."""

    slot: int
    start: int
    targets: tuple[int, ...]
    logprob: torch.Tensor  # fp32 [n]
    rank: torch.Tensor  # int64 [n]: 1 + the tokens more likely than the target
    top_ids: torch.Tensor  # int64 [n, k]
    top_logprobs: torch.Tensor  # fp32 [n, k]


# prompt logprobs: rows through the lm_head at once, so that their fp32 logits take at most
# this (a few such tensors live at once: well inside the CUDA memory reserve)
SCORE_BYTES = 32 << 20


@dataclass(frozen=True)
class _Window:
    """A decode window as launched."""

    traversals: int
    b: int  # rows [0, b) of the event buffers hold its slots' events
    flags: Flags
    base: int  # its first row in the event buffers


@dataclass
class Launched:
    """A plan enqueued on the device; its read back lands in `host` once `done` fires."""

    firsts: list[_FirstTokens]
    window: _Window | None
    scored: list[_Scored]
    host: list[torch.Tensor]
    done: torch.cuda.Event | None  # None on the CPU: everything already ran
    logprobs_wanted: dict[int, int | None]  # slot -> logprobs its request asked for, at launch


class ModelRunner:
    def __init__(
        self,
        model: LoopedCausalLM,
        num_blocks: int,
        block_size: int,
        *,
        num_slots: int,
        max_blocks: int,
        num_planes: int,
        refill: bool = True,
        execution: ExecutionConfig | None = None,
    ) -> None:
        cfg, execution = model.config, execution or ExecutionConfig()
        self.model, self.block_size, self.depth = model, block_size, model.num_loops
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.shared, self.refill = num_planes == 1 and self.depth > 1, refill
        backend = attention_backend(execution.attention_backend, self.device)
        self.kv = backend(
            cfg.num_layers,
            num_blocks * block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.num_heads,
            block_size,
            self.dtype,
            self.device,
        )
        self.slots = SlotBatch(
            num_slots, num_planes, max_blocks, cfg.hidden_size, self.dtype, self.device,
            vocab_size=model.lm_head.weight.shape[0],  # the logits' width
        )  # fmt: skip
        self.events = EventBuffers(execution.decode_window, num_slots, MAX_LOGPROBS, self.device)
        cuda = self.device.type == "cuda"
        self._read_back_stream = torch.cuda.Stream(self.device) if cuda else None
        triton = isinstance(self.kv, TritonPagedAttention)
        self.traversal = DecodeTraversal(
            model,
            self.kv,
            self.slots,
            self.events,
            refill=refill,
            shared=self.shared,
            fused=triton and slot_step.enabled(),
        )
        if triton:
            model.use_fast_path()  # packed weights, fused norm and RoPE kernels
        capturable = isinstance(self.kv, TritonPagedAttention) and self.device.type == "cuda"
        self.captures = CaptureTally()
        self.graphs = (
            GraphCache(self.traversal, num_slots, self.captures)
            if (capturable and not execution.enforce_eager)
            else None
        )
        self.prefill = PrefillRunner(
            model,
            self.kv,
            self.slots,
            shared=self.shared,
            fixed_shapes=isinstance(self.kv, TritonPagedAttention),
            graph_pool=self.graphs.pool if self.graphs is not None else None,
            tally=self.captures,
        )
        # a riding wave's state at fixed addresses (worker/decode.py's RidingWave)
        self._rider_hidden = torch.zeros(
            MAX_GRAPH_ROWS, cfg.hidden_size, dtype=self.dtype, device=self.device
        )
        self._rider_firsts = torch.zeros(3, num_slots + 1, dtype=torch.long, device=self.device)
        self._armed = torch.ones(1, dtype=torch.bool, device=self.device)
        self.snapshots: dict[int, _Snapshot] = {}  # preempted requests, in host memory

    # -- the step ------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Launched:
        for out in plan.swap_outs:
            self._swap_out(out)
        for slot in plan.slot_frees:
            self.slots.clear(slot)
        for snapshot in plan.snapshot_drops:
            self.snapshots.pop(snapshot, None)
        for init in plan.slot_inits:
            self.slots.init(init, self.depth)
        for swap_in in plan.swap_ins:
            self._swap_in(swap_in)
        for append in plan.block_appends:
            self.slots.append(append.slot, append.blocks)
        for update in plan.mask_updates:
            self.slots.release(update.slot, update.mask)
        self.slots.flush()
        waves, rider, layout = plan.prefill, None, None
        if plan.wave_rides:
            if len(waves) != 1 or plan.decode_traversals < self.depth:
                raise ValueError(
                    f"a riding wave needs exactly one wave and a window of >= {self.depth} "
                    f"traversals, got {len(waves)} and {plan.decode_traversals}"
                )
            layout = WaveLayout.of(waves[0])
            rider, waves = self._rider(waves[0], layout), ()
        scored: list[_Scored] = []
        firsts = [self._prefill(wave, scored) for wave in waves]
        window = (
            self._decode(plan.decode_traversals, plan.decode_keys, rider, layout)
            if plan.decode_traversals
            else None
        )
        return self._start_read_back([f for f in firsts if f is not None], window, scored)

    @property
    def max_ride_rows(self) -> int | None:
        """The largest prefill wave that rides a decode window in its captured graphs (a
        larger one would ride eagerly, launch by launch); None without CUDA graphs."""
        return self.prefill.max_rows if self.graphs is not None else None

    def startup_flags(self, variants: list[Flags]) -> list[Flags]:
        """The decode-graph flags start-up captures for `variants` (the sampling flags of
        default requests): each with every attention launch plan a window of them may need.
        On Triton that is two (contexts below LONG_CONTEXT keys or not, `long_context`), so a
        request whose context grows past it captures nothing while serving."""
        plans = (False, True) if self._has_long_context_plan() else (False,)
        return [dataclasses.replace(f, long_context=p) for f in variants for p in plans]

    def capture_graphs(self, variants: list[Flags]) -> int:
        """Capture ahead of the first request (a capture on first use stalls every request in
        flight): for each of `startup_flags(variants)` the decode traversal at every batch
        bucket, and at each of those a riding wave of every row bucket; prefill waves at every
        row bucket. Left for first use: other sampling flags. Returns how many graphs were
        captured; 0 without CUDA graphs."""
        if self.graphs is None:
            return 0
        count = self.prefill.capture_buckets()
        for flags in self.startup_flags(variants):
            for b in self.graphs.buckets:
                count += not self.graphs.captured(b, flags)
                self.graphs.ensure(b, flags)
            for rows in self.prefill.buckets.rows:
                rider = self._fixed_rider(self.prefill.empty_inputs(rows))
                for b in self.graphs.buckets:
                    count += not self.graphs.captured(b, flags, rider)
                    self.graphs.ensure(b, flags, rider)
        torch.cuda.empty_cache()  # the warm-up runs' memory (graphs.capture keeps it cached)
        return count

    def active_slots(self) -> list[int]:
        """Slots with device state (for leak checks)."""
        return sorted(self.slots.host)

    # -- prefill -------------------------------------------------------------------------
    def _prefill(
        self, wave: tuple[PrefillChunk, ...], scored: list[_Scored]
    ) -> _FirstTokens | None:
        """Chunks of several requests through every loop; the chunks that end their prompt
        sample the first token and start their slots decoding. Chunks with logprob targets
        add their prompt logprobs to `scored`."""
        dev, s = self.device, self.slots
        layout = WaveLayout.of(wave)
        hidden = self.prefill(layout)
        counts, firsts = layout.counts, layout.firsts
        for i, chunk in enumerate(wave):
            if chunk.logprob_targets:
                scored.append(self._score(chunk, hidden[firsts[i] : firsts[i + 1]]))
        last = [i for i, c in enumerate(wave) if c.last]
        if not last:
            return None
        rows = upload(torch.tensor([firsts[i + 1] - 1 for i in last]), dev)
        slots = [wave[i].slot for i in last]
        index = upload(torch.tensor(slots), dev)
        drawn = self._sample(self.model.coda(hidden[rows]), index, slots)
        if self.slots.any_logit_edits(slots):
            s.count_output(index, drawn.token, torch.ones_like(index, dtype=torch.bool))
        positions = upload(torch.tensor([wave[i].start + counts[i] for i in last]), dev)
        s.start_decode(index, drawn.token, positions, self.refill)
        return _FirstTokens(slots, drawn)

    def _score(self, chunk: PrefillChunk, hidden: torch.Tensor) -> _Scored:
        """The logprobs of the chunk's targets from its rows' final hidden states (the full
        depth), and the top k (the request's prompt_logprobs) of each row: the raw fp32
        logits' log_softmax, as the sampler's logprobs, a few rows at a time."""
        k = self.slots.host[chunk.slot].params.prompt_logprobs or 0
        n = len(chunk.logprob_targets)
        targets = upload(torch.tensor(chunk.logprob_targets), self.device)
        piece = max(1, SCORE_BYTES // (4 * self.model.config.vocab_size))
        parts: list[tuple[torch.Tensor, ...]] = []
        for a in range(0, n, piece):
            logits = self.model.coda(hidden[a : min(n, a + piece)])
            logp = logits.float().log_softmax(-1)
            target = logp.gather(1, targets[a : a + piece, None])
            rank = (logp > target).sum(-1) + 1
            parts.append((target[:, 0], rank, *logp.topk(k, dim=-1)))
        logprob, rank, values, ids = (torch.cat(p) for p in zip(*parts, strict=True))
        return _Scored(chunk.slot, chunk.start, chunk.logprob_targets, logprob, rank, ids, values)

    def _sample(self, logits: torch.Tensor, index: torch.Tensor, slots: list[int]) -> SampleOutput:
        s = self.slots
        any_random, any_filter, num_logprobs = s.sampling_flags(slots)
        first = torch.zeros_like(index)  # the first output token has index 0
        return sample(
            logits,
            SamplingTensors(
                s.temperature[index], s.top_k[index], s.top_p[index], s.seed[index], first
            ),
            any_random=any_random,
            any_filter=any_filter,
            num_logprobs=num_logprobs,
            edits=s.logit_edits(index, first) if s.any_logit_edits(slots) else None,
        )

    def _rider(self, wave: tuple[PrefillChunk, ...], layout: WaveLayout) -> RidingWave:
        """A wave to ride the window. A fixed-shape one (a row bucket) keeps everything at
        fixed addresses, its first tokens padded to the bucket's sequences by repeating the
        first (the same writes again), so the riding traversal is one graph per row bucket. A
        wave of mid-prompt chunks only runs the same graph disarmed: its gated coda skips the
        lm_head, and nothing starts decoding."""
        inputs = self.prefill.inputs_for(layout)
        last = [i for i, c in enumerate(wave) if c.last]
        self._armed.fill_(bool(last))  # a kernel, not a copy: no wait for the stream
        firsts = [
            [layout.firsts[i + 1] - 1 for i in last],
            [wave[i].slot for i in last],
            [wave[i].start + layout.counts[i] for i in last],
        ]
        if inputs.valid is None:  # an exact-shape wave: eager only
            rows, slots, prompt_lens = upload(torch.tensor(firsts, dtype=torch.long), self.device)
            width = self._rider_hidden.shape[1]
            hidden = torch.zeros(inputs.rows, width, dtype=self.dtype, device=self.device)
            return RidingWave(
                inputs, self.prefill.metadata, hidden, rows, slots, prompt_lens, self._armed
            )
        rider = self._fixed_rider(inputs)
        n, padded = len(last), rider.first_rows.numel()
        # none: rows, slots and lengths 0, in range of any bucket (the gated coda still reads)
        host = torch.tensor([f + f[:1] * (padded - n) if n else [0] * padded for f in firsts])
        self._rider_firsts[:, :padded].copy_(upload(host, self.device))
        return rider

    def _fixed_rider(self, inputs: WaveInputs) -> RidingWave:
        """A riding wave at a row bucket's fixed addresses, room for a first token per
        sequence of the bucket; its graph's key is the bucket."""
        padded = int(inputs.slot.shape[0])
        rows, slots, prompt_lens = self._rider_firsts[:, :padded]
        hidden = self._rider_hidden[: inputs.rows]
        key = inputs.rows
        return RidingWave(
            inputs, self.prefill.metadata, hidden, rows, slots, prompt_lens, self._armed, key
        )

    # -- decode --------------------------------------------------------------------------
    def _decode(
        self,
        traversals: int,
        keys: int,
        rider: RidingWave | None = None,
        layout: WaveLayout | None = None,
    ) -> _Window | None:
        """`keys`: the most keys a row may attend to in this window (`StepPlan.decode_keys`)."""
        b = self.slots.span()
        if b == 0:
            return None
        flags = Flags(
            *self.slots.flags(),
            long_context=self.long_context(keys),
            logit_edits=self.slots.any_logit_edits(),
        )
        ev = self.events
        if traversals > ev.window:
            raise ValueError(f"a window of {traversals} traversals exceeds {ev.window}")
        base = ev.start()
        if self.graphs is not None:
            if rider is not None and rider.key is None:  # an exact-shape wave: eager
                # its eager traversals write the events of slots [0, b), the graphs' of
                # [0, padded b): no stale event in between
                ev.token[base : base + traversals].fill_(-1)
                for _ in range(self.depth):
                    self.traversal(b, flags, rider)
                b = self.graphs.replay(b, flags, traversals - self.depth)
                return _Window(traversals, b, flags, base)
            if rider is not None and not self.graphs.captured(b, flags, rider):
                # captured on an empty wave (its warm-up runs execute it), then put back
                assert layout is not None
                self.prefill.upload(WaveLayout.empty(), rider.inputs.rows)
                self.graphs.ensure(self.graphs.padded(b), flags, rider)
                self.prefill.upload(layout, rider.inputs.rows)
            b = self.graphs.replay(b, flags, traversals, rider)
            return _Window(traversals, b, flags, base)
        self.traversal.max_seq_len = self.slots.max_context(self.block_size)
        for t in range(traversals):
            self.traversal(b, flags, rider if t < self.depth else None)
        return _Window(traversals, b, flags, base)

    def long_context(self, keys: int) -> bool:
        """Whether a window whose rows attend to at most `keys` keys takes the attention's
        long-context launch plan: the Triton attention picks its kernel and split-K by it (a
        static variant: the kernel cannot read seq_lens on the host). Both plans are exact."""
        return self._has_long_context_plan() and keys >= LONG_CONTEXT

    def _has_long_context_plan(self) -> bool:
        return isinstance(self.kv, TritonPagedAttention)

    # -- the one read back ---------------------------------------------------------------
    def _start_read_back(
        self, firsts: list[_FirstTokens], window: _Window | None, scored: list[_Scored]
    ) -> Launched:
        """Enqueue the step's device-to-host copies (pinned, non-blocking) behind its work, on
        the read back stream (CUDA). The tensors stay alive until `collect` has waited for
        them: the first tokens' in `Launched.firsts`, the window's in the event buffers, whose
        half the window after next writes only once these copies are done (`EventBuffers.read`)."""
        ev = self.events
        tensors: list[torch.Tensor] = []
        for f in firsts:
            tensors.append(f.drawn.token)
            if f.drawn.logprob is not None:
                tensors += [f.drawn.logprob, f.drawn.top_ids, f.drawn.top_logprobs]
        if window is not None:
            rows = slice(window.base, window.base + window.traversals)
            tensors.append(ev.token_depth[rows])  # [n, 2, slots]: contiguous, one copy
            if window.flags.num_logprobs is not None:
                k, b = window.flags.num_logprobs, window.b
                tensors += [ev.logprob[rows, :b], ev.top_ids[rows, :b, :k]]
                tensors.append(ev.top_logprobs[rows, :b, :k])
        for sc in scored:
            tensors += [sc.logprob, sc.rank, sc.top_ids, sc.top_logprobs]
        wanted = {slot: h.params.logprobs for slot, h in self.slots.host.items()}
        if self._read_back_stream is None:
            # the CPU: copies now (the event buffers are reused by a later launch, which may
            # come before this plan is collected)
            return Launched(firsts, window, scored, [t.clone() for t in tensors], None, wanted)
        stream = self._read_back_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host = [t.to("cpu", non_blocking=True) for t in tensors]
            done = torch.cuda.Event()
            done.record(stream)
        if window is not None:
            ev.read(done)
        return Launched(firsts, window, scored, host, done, wanted)

    def collect(self, launched: Launched) -> StepResult:
        """Wait for a launched plan and turn its read back into token events."""
        if launched.done is not None:
            launched.done.synchronize()
        firsts, window = launched.firsts, launched.window
        it = iter(launched.host)
        events: list[TokenEvent] = []
        for f in firsts:
            tokens = next(it).tolist()
            extra = (next(it), next(it), next(it)) if f.drawn.logprob is not None else None
            for i, (slot, token) in enumerate(zip(f.slots, tokens, strict=True)):
                smp = _as_sample(launched.logprobs_wanted.get(slot), token, extra, i)
                events.append(TokenEvent(slot, smp, self.depth))
        if window is not None:
            b = window.b
            token_depth = next(it)
            tokens, depths = token_depth[:, 0, :b].tolist(), token_depth[:, 1, :b].tolist()
            extra = (
                (next(it), next(it), next(it)) if window.flags.num_logprobs is not None else None
            )
            wanted = launched.logprobs_wanted
            for t, (row, row_depths) in enumerate(zip(tokens, depths, strict=True)):
                for slot, token in enumerate(row):
                    if token >= 0:
                        smp = _as_sample(wanted.get(slot), token, extra, (t, slot))
                        events.append(TokenEvent(slot, smp, row_depths[slot]))
        prompt = []
        for sc in launched.scored:
            lp, ranks, ids, tops = (next(it).tolist() for _ in range(4))
            samples = (
                Sample(target, logprob, tuple(zip(row_ids, row_tops, strict=True)), rank)
                for target, logprob, rank, row_ids, row_tops in zip(
                    sc.targets, lp, ranks, ids, tops, strict=True
                )
            )
            prompt.append(PromptLogprobs(sc.slot, sc.start, tuple(samples)))
        return StepResult(tuple(events), tuple(prompt))

    # -- preemption: every plane's pages and the slot's device state, exactly -----------
    def _block_slots(self, blocks: tuple[int, ...]) -> torch.Tensor:
        offsets = torch.arange(self.block_size)
        slots = (torch.tensor(list(blocks))[:, None] * self.block_size + offsets).flatten()
        return upload(slots, self.device)

    def _swap_out(self, op: SwapOut) -> None:
        slots = self._block_slots(op.blocks)
        self.snapshots[op.snapshot] = _Snapshot(
            k=to_host(self.kv.k[:, slots]),
            v=to_host(self.kv.v[:, slots]),
            slot=self.slots.snapshot(op.slot),
        )
        self.slots.clear(op.slot)

    def _swap_in(self, op: SwapIn) -> None:
        snap = self.snapshots.pop(op.snapshot)
        slots = self._block_slots(op.blocks)
        self.kv.k[:, slots] = upload(snap.k, self.device)
        self.kv.v[:, slots] = upload(snap.v, self.device)
        self.slots.restore(op.slot, snap.slot, op.block_tables)


def _as_sample(
    wanted: int | None, token: int, extra: tuple | None, index: int | tuple[int, int]
) -> Sample:
    """A `Sample` from the read-back tensors, with the logprobs its request asked for (as the
    slot's request was when the plan was launched: the slot may have a new owner since)."""
    if extra is None or wanted is None:
        return Sample(token)
    logprob, top_ids, top_logprobs = extra
    ids, values = top_ids[index][:wanted].tolist(), top_logprobs[index][:wanted].tolist()
    return Sample(token, float(logprob[index]), tuple(zip(ids, values, strict=True)))
