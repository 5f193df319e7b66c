"""One decode traversal over slots [0, B) of the slot batch, entirely on the device.

Each slot's token goes one loop deeper: loop-0 rows embed their token (the prelude), every row
writes its K/V into the plane of its loop and reads that plane through its own block table, the
gate's hazard feeds the fp32 exit rule (the same arithmetic as `core/exit_rule.py`), and rows
that exit are sampled (lm_head, counter-based RNG) and re-enter at loop 0 with the new token in
the very next traversal. LAST_EXITED exit copies land in the deeper planes in the same step.
Shapes depend only on B and static flags, so a traversal is captured as one CUDA graph per
(B, flags) and replayed `window` times; events go to a [window, slots] half of the event
buffers, read back once.

A prefill wave may ride the first `depth` traversals of a window (`RidingWave`): its rows go
one loop deeper per traversal beside the decode rows, so its GEMM rows share the weight reads
the decode rows pay anyway instead of a pass of their own per loop. Its loop is the window's
traversal counter (a device value); at the last loop the chunks that end their prompt sample
their first token, and their slots decode from the next traversal on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlt_engine.kernels import slot_step
from rlt_engine.kernels.argmax import Partials
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.worker.attention import MixedMetadata, PagedKVCache, PagedMetadata
from rlt_engine.worker.batched_sampler import SampleOutput, SamplingTensors, sample
from rlt_engine.worker.slot_batch import SlotBatch

if TYPE_CHECKING:  # prefill.py imports graphs.py, which imports this module
    from rlt_engine.worker.prefill import WaveInputs


@dataclass(frozen=True)
class Flags:
    """Static variants of a traversal (each its own graph)."""

    any_random: bool
    any_filter: bool
    num_logprobs: int | None
    early_exits: bool
    long_context: bool = False  # rows may attend to LONG_CONTEXT keys: attention's launch plan
    logit_edits: bool = False  # a row's bias or penalties change its logits (LogitEdits)


class EventBuffers:
    """Token events written on the device, a [window, slots] half per window, read back once
    per window. Windows alternate between the two halves (`start`), so a window's read back,
    a copy on a stream of its own, never holds up the next window's kernels."""

    def __init__(self, window: int, num_slots: int, max_logprobs: int, device: torch.device):
        self.window = window
        rows = 2 * window
        # token and depth events side by side in one buffer, so that a window's rows come back
        # in one contiguous copy (read_back)
        self.token_depth = torch.zeros((rows, 2, num_slots), dtype=torch.long, device=device)
        self.token, self.depth = self.token_depth[:, 0], self.token_depth[:, 1]
        self.token.fill_(-1)
        self.logprob = torch.zeros((rows, num_slots), dtype=torch.float32, device=device)
        self.top_ids = torch.zeros((rows, num_slots, max_logprobs), dtype=torch.long, device=device)
        self.top_logprobs = torch.zeros((rows, num_slots, max_logprobs), device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)  # traversal index
        self.base = torch.zeros(1, dtype=torch.long, device=device)  # the window's first row
        self.ticket = torch.zeros(1, dtype=torch.int32, device=device)  # see slot_step.Events
        self.half = 0  # the half the last window wrote
        # the read back of the last window that wrote each half (CUDA; see `read`)
        self.copied: list[torch.cuda.Event | None] = [None, None]

    def start(self) -> int:
        """Point the next window at the other half, once that half's last read back is done;
        its first row. The advance writes every event of slots [0, b) in each traversal, so a
        window whose traversals all run over the same b needs no clearing of its rows."""
        self.half ^= 1
        copied = self.copied[self.half]
        if copied is not None:
            torch.cuda.current_stream(self.step.device).wait_event(copied)
        base = self.half * self.window
        self.step.zero_()
        self.base.fill_(base)
        return base

    def read(self, done: torch.cuda.Event) -> None:
        """The current window's read back fires `done`: its half is free again after it."""
        self.copied[self.half] = done

    def row(self) -> torch.Tensor:
        """[1] int64: the row the traversal writes (base + step)."""
        return self.base + self.step


@dataclass(frozen=True)
class RidingWave:
    """A prefill wave in the first `depth` traversals of a window (see the module doc)."""

    inputs: WaveInputs
    metadata: Callable[[WaveInputs, torch.Tensor], PagedMetadata]  # (wave, loops) -> metadata
    hidden: torch.Tensor  # [rows, H]: each row's input to its next loop
    first_rows: torch.Tensor  # [n] int64: last rows of the chunks that end their prompt
    first_slots: torch.Tensor  # [n] int64: their slots
    prompt_lens: torch.Tensor  # [n] int64: their prompt lengths (position of the first token)
    # [1] bool: whether the last loop may start slots decoding (off while a graph is captured,
    # and for a wave whose chunks are all mid-prompt)
    armed: torch.Tensor
    # the graph variant of a fixed-shape wave: its row bucket; None: eager only
    key: int | None = None


class DecodeTraversal:
    def __init__(
        self,
        model: LoopedCausalLM,
        kv: PagedKVCache,
        slots: SlotBatch,
        events: EventBuffers,
        *,
        refill: bool,
        shared: bool,
        fused: bool = False,
    ) -> None:
        self.model, self.kv, self.s, self.ev = model, kv, slots, events
        self.depth = model.num_loops
        self.refill, self.shared = refill, shared
        # the rows' bookkeeping (prepare, the exit rule where a row may exit early, advance)
        # as Triton launches and greedy draws through the gated argmax, instead of ~50 torch
        # kernels (kernels/slot_step.py, whose torch references run otherwise)
        self.fused = fused
        device = slots.device
        self.query_start = torch.arange(slots.num_slots + 1, dtype=torch.int32, device=device)
        self.max_seq_len = 0  # host bound for the torch backend (eager only)
        # tests: set to [] to record (loop, running, exits) of slots [0, B) per eager traversal
        self.trace: list[tuple[list[int], list[bool], list[bool]]] | None = None

    @torch.inference_mode()
    def __call__(self, b: int, flags: Flags, wave: RidingWave | None = None) -> None:
        s, bs, trash = self.s, self.kv.block_size, self.kv.trash_slot
        self.kv.long_context = flags.long_context
        active, parked = s.active[:b], s.parked[:b]
        if not self.refill:  # the cohort starts together once everyone has exited
            release = (parked | ~active).all()
            parked.logical_and_(~release)
        loop, pos = s.loop[:b], s.position[:b]
        prepare = slot_step.prepare if self.fused else slot_step.prepare_reference
        # a window in which no row may exit early knows its exits before the layer stack
        decided = not flags.early_exits
        # loop-0 rows gather their token's embedding, and every row its RoPE rows, in the
        # same launch (the model's tables: prelude and rotary_emb's values), and the first
        # layer's norm (the Triton path, without a wave whose rows the launch does not see)
        rows = prepare(
            loop, pos, active, parked, s.token[:b], self.model.embedding, s.hidden[:b],
            s.block_tables[:b], bs, trash, self.shared, self.model.rope_table(s.hidden.dtype),
            norm=self.model.first_norm() if self.fused and wave is None else None,
            max_loops=s.max_loops[:b] if decided else None,
        )  # fmt: skip
        run, block, offset, slot_mapping = rows.run, rows.block, rows.offset, rows.slot_mapping
        meta = PagedMetadata(
            positions=pos,
            loop_indices=loop,
            slot_mapping=slot_mapping,
            block_tables=rows.tables,
            seq_lens=rows.seq_lens,
            query_start=self.query_start[: b + 1],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )
        if wave is None:
            out = self.model.recurrent(rows.x, meta, self.kv, rope=rows.rope, normed=rows.normed)
            hidden, hazard = out.hidden, out.hazard
        else:
            x, mixed = self._with_wave(rows.x, meta, wave)
            out = self.model.recurrent(x, mixed, self.kv)
            hidden, hazard = out.hidden[:b], None if out.hazard is None else out.hazard[:b]
        exits, gate = (rows.exits, rows.gate) if decided else self._exit_rule(b, hazard, loop)
        # a traversal in which no row exits (most of them at fixed depth in lockstep) skips
        # the lm_head's weight read; its draws are then never recorded or used
        if (
            self.fused
            and not (flags.any_random or flags.logit_edits)
            and flags.num_logprobs is None
        ):
            # greedy: the lm_head gives the argmax's partials (its epilogue's), and the
            # advance reduces each exiting row's itself (kernels/small_gemm, kernels/argmax)
            drawn = self.model.coda(hidden, gate=gate, greedy=True)
        else:
            index = s.generated[:b]  # of the token each row draws
            sampling = SamplingTensors(
                s.temperature[:b], s.top_k[:b], s.top_p[:b], s.seed[:b], index
            )
            drawn = sample(
                self.model.coda(hidden, gate=gate),
                sampling,
                any_random=flags.any_random,
                any_filter=flags.any_filter,
                num_logprobs=flags.num_logprobs,
                edits=s.logit_edits(slice(0, b), index) if flags.logit_edits else None,
            )
            self._record_logprobs(b, drawn)
            drawn = drawn.token
            if flags.logit_edits:  # the exiting rows' tokens join their outputs
                s.count_output(slice(0, b), drawn, exits)
        if flags.early_exits and not self.shared and self.depth > 1:
            # a token that exits after loop e lends its K/V to each deeper plane, so later
            # queries at loop d read version min(d, e)
            self.kv.exit_copies(exits, loop, block, offset, slot_mapping, s.block_tables[:b])
        if self.trace is not None:
            self.trace.append((loop.tolist(), run.tolist(), exits.tolist()))
        # the next traversal writes the next row of the event buffers: the advance moves the
        # row on, unless a riding wave still writes this one
        self._advance(b, exits, drawn, hazard, hidden, step_up=wave is None)
        if flags.logit_edits:  # (structured output is among the edits)
            s.hold_constrained(b, exits)
        if wave is not None:
            self._wave_done(wave, out.hidden[b:], flags)
            self.ev.step.add_(1)

    # -- a riding prefill wave -------------------------------------------------------------
    def _with_wave(
        self, x: torch.Tensor, meta: PagedMetadata, wave: RidingWave
    ) -> tuple[torch.Tensor, MixedMetadata]:
        """The traversal's input rows and metadata with the wave's rows after the decode rows;
        the wave is at loop `step` (it entered at the window's first traversal)."""
        step = self.ev.step
        rows = wave.inputs
        loops = step.expand(rows.rows)
        # loop 0 embeds the prompt; later loops continue from the previous loop's output
        x_wave = torch.where(step == 0, self.model.prelude(rows.ids).to(x.dtype), wave.hidden)
        part = wave.metadata(rows, loops)
        mixed = MixedMetadata(
            positions=torch.cat([meta.positions, part.positions]),
            loop_indices=torch.cat([meta.loop_indices, loops]),
            slot_mapping=torch.cat([meta.slot_mapping, part.slot_mapping]),
            decode=meta,
            chunks=part,
            split=x.shape[0],
        )
        return torch.cat([x, x_wave]), mixed

    def _wave_done(self, wave: RidingWave, hidden: torch.Tensor, flags: Flags) -> None:
        """Keep the wave's rows for their next loop; after the last loop, sample the first
        token of each chunk that ends its prompt and start its slot decoding (gated on the
        device by the loop)."""
        wave.hidden.copy_(hidden)
        if wave.first_rows.numel() == 0:
            return
        s, step, slots = self.s, self.ev.step, wave.first_slots
        last = (step == self.depth - 1) & wave.armed  # [1]: the wave's last loop
        gate = last.int()
        first = torch.zeros_like(slots)  # the first output token has index 0
        drawn = sample(
            self.model.coda(hidden[wave.first_rows], gate=gate),
            SamplingTensors(
                s.temperature[slots], s.top_k[slots], s.top_p[slots], s.seed[slots], first
            ),
            any_random=flags.any_random,
            any_filter=flags.any_filter,
            num_logprobs=flags.num_logprobs,
            gate=gate if self.fused else None,
            edits=s.logit_edits(slots, first) if flags.logit_edits else None,
        )
        if flags.logit_edits:
            s.count_output(slots, drawn.token, last.expand_as(slots))
        s.start_decode(slots, drawn.token, wave.prompt_lens, self.refill, when=last)
        self._record_first(wave, drawn, last)

    def _record_first(self, wave: RidingWave, drawn: SampleOutput, last: torch.Tensor) -> None:
        """The first tokens' events, in the traversal's row of the event buffers (after the
        decode rows' advance wrote that row: the wave's slots were idle there)."""
        ev, slots = self.ev, wave.first_slots
        at = (ev.row().expand_as(slots), slots)

        def put(buffer: torch.Tensor, value: torch.Tensor | int) -> None:
            buffer.index_put_(at, torch.where(last, value, buffer[at]))

        put(ev.token, drawn.token)
        put(ev.depth, self.depth)
        if drawn.logprob is not None:
            put(ev.logprob, drawn.logprob)
            n = drawn.top_ids.shape[1]
            if n:
                put(ev.top_ids[:, :, :n], drawn.top_ids)
                put(ev.top_logprobs[:, :, :n], drawn.top_logprobs)

    def _exit_rule(
        self, b: int, hazard: torch.Tensor | None, loop: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(exits, the lm_head gate) of rows [0, b) in a window in which a row may exit
        early."""
        s = self.s
        rule = slot_step.exit_rule if self.fused else slot_step.exit_rule_reference
        early = None
        if hazard is not None:
            early = slot_step.EarlyExit(s.remaining[:b], hazard, s.min_loops[:b], s.threshold[:b])
        return rule(loop, s.active[:b], s.parked[:b], s.max_loops[:b], early)

    def _advance(
        self,
        b: int,
        exits: torch.Tensor,
        drawn: torch.Tensor | Partials,
        hazard: torch.Tensor | None,
        hidden: torch.Tensor,
        step_up: bool,
    ) -> None:
        """The traversal's row of the token and depth events, then every running row one loop
        on (its exit mass too, given the hazard); rows that exited start their next token at
        loop 0 (or finish)."""
        s, ev = self.s, self.ev
        advance = slot_step.advance if self.fused else slot_step.advance_reference
        rows = slot_step.Rows(
            s.token[:b], s.hidden[:b], s.loop[:b], s.remaining[:b], s.position[:b],
            s.generated[:b], s.active[:b], s.parked[:b], s.max_tokens[:b], s.stop_ids[:b],
        )  # fmt: skip
        events = slot_step.Events(ev.token, ev.depth, ev.step, ev.base, ev.ticket)
        advance(exits, drawn, hazard, hidden, rows, events, self.refill, step_up)

    def _record_logprobs(self, b: int, drawn) -> None:
        """The traversal's row of the logprob event buffers (device counters: no host index
        in the graph); the token and depth events are written by the advance."""
        if drawn.logprob is None:
            return
        ev = self.ev
        t = ev.row()
        ev.logprob[:, :b].index_copy_(0, t, drawn.logprob[None])
        n = drawn.top_ids.shape[1]
        if n:
            ev.top_ids[:, :b, :n].index_copy_(0, t, drawn.top_ids[None])
            ev.top_logprobs[:, :b, :n].index_copy_(0, t, drawn.top_logprobs[None])
