"""One decode traversal over slots [0, B) of the slot batch, entirely on the device.

Each slot's token goes one loop deeper: loop-0 rows embed their token (the prelude), every row
writes its K/V into the plane of its loop and reads that plane through its own block table, the
gate's hazard feeds the fp32 exit rule (the same arithmetic as `core/exit_rule.py`), and rows
that exit are sampled (lm_head, counter-based RNG) and re-enter at loop 0 with the new token in
the very next traversal. LAST_EXITED exit copies land in the deeper planes in the same step.
Shapes depend only on B and static flags, so a traversal is captured as one CUDA graph per
(B, flags) and replayed `window` times; events go to [window, slots] buffers read back once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.worker.attention import PagedKVCache, PagedMetadata
from rlt_engine.worker.batched_sampler import SamplingTensors, sample
from rlt_engine.worker.slot_batch import SlotBatch


@dataclass(frozen=True)
class Flags:
    """Static variants of a traversal (each its own graph)."""

    any_random: bool
    any_filter: bool
    num_logprobs: int | None
    early_exits: bool
    long_context: bool = False  # tables reach LONG_CONTEXT keys: attention's launch plan


class EventBuffers:
    """[window, slots] token events written on the device, read back once per window."""

    def __init__(self, window: int, num_slots: int, max_logprobs: int, device: torch.device):
        self.window = window
        self.token = torch.full((window, num_slots), -1, dtype=torch.long, device=device)
        self.depth = torch.zeros((window, num_slots), dtype=torch.long, device=device)
        self.logprob = torch.zeros((window, num_slots), dtype=torch.float32, device=device)
        self.top_ids = torch.zeros(
            (window, num_slots, max_logprobs), dtype=torch.long, device=device
        )
        self.top_logprobs = torch.zeros((window, num_slots, max_logprobs), device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)  # traversal index


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
    ) -> None:
        self.model, self.kv, self.s, self.ev = model, kv, slots, events
        self.depth = model.num_loops
        self.refill, self.shared = refill, shared
        device = slots.device
        self.query_start = torch.arange(slots.num_slots + 1, dtype=torch.int32, device=device)
        self.deeper = torch.arange(1, self.depth, device=device)  # planes an exit may copy to
        self.max_seq_len = 0  # host bound for the torch backend (eager only)
        # tests: set to [] to record (loop, running, exits) of slots [0, B) per eager traversal
        self.trace: list[tuple[list[int], list[bool], list[bool]]] | None = None

    @torch.inference_mode()
    def __call__(self, b: int, flags: Flags) -> None:
        s, bs, trash = self.s, self.kv.block_size, self.kv.trash_slot
        self.kv.long_context = flags.long_context
        active, parked = s.active[:b], s.parked[:b]
        if not self.refill:  # the cohort starts together once everyone has exited
            release = (parked | ~active).all()
            parked.logical_and_(~release)
        run = active & ~parked
        loop, pos = s.loop[:b], s.position[:b]
        embedded = self.model.prelude(s.token[:b])
        x = torch.where((loop == 0)[:, None], embedded, s.hidden[:b])
        plane = torch.zeros_like(loop) if self.shared else loop
        width = s.max_blocks
        tables = s.block_tables[:b].gather(1, plane[:, None, None].expand(b, 1, width))[:, 0]
        # an idle row's position may sit one past its tables (its last token never runs):
        # clamp so the gather stays in bounds; such rows write only the trash slot
        block, offset = (pos // bs).clamp(max=width - 1), pos % bs
        own = tables.gather(1, block[:, None])[:, 0].long() * bs + offset
        slot_mapping = torch.where(run, own, trash)
        meta = PagedMetadata(
            positions=pos,
            loop_indices=loop,
            slot_mapping=slot_mapping,
            block_tables=tables,
            seq_lens=(pos + 1).to(torch.int32),
            query_start=self.query_start[: b + 1],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )
        out = self.model.recurrent(x, meta, self.kv)
        done = loop + 1
        exits = done >= s.max_loops[:b]
        remaining = s.remaining[:b]
        if out.hazard is not None:
            # f32 exactly as ExitTracker: R = R * (1 - h); exit when 1 - R >= threshold
            remaining = remaining * (1.0 - out.hazard)
            # (a threshold of 1 is stored as 2: fixed depth never exits early)
            early = (done >= s.min_loops[:b]) & (1.0 - remaining >= s.threshold[:b])
            exits = exits | early
        exits = exits & run
        drawn = sample(
            # a traversal in which no row exits (most of them at fixed depth in lockstep)
            # skips the lm_head's weight read; its draws are then never recorded or used
            self.model.coda(out.hidden, gate=exits.any()),
            SamplingTensors(
                s.temperature[:b], s.top_k[:b], s.top_p[:b], s.seed[:b], s.generated[:b]
            ),
            any_random=flags.any_random,
            any_filter=flags.any_filter,
            num_logprobs=flags.num_logprobs,
        )
        if flags.early_exits and not self.shared and self.depth > 1:
            self._exit_copies(b, exits, loop, block, offset, slot_mapping)
        self._record(b, exits, done, drawn)
        if self.trace is not None:
            self.trace.append((loop.tolist(), run.tolist(), exits.tolist()))
        # advance every running row; rows that exited start their next token at loop 0
        s.hidden[:b] = torch.where(run[:, None], out.hidden, s.hidden[:b])
        s.token[:b] = torch.where(exits, drawn.token, s.token[:b])
        s.loop[:b] = torch.where(exits, 0, torch.where(run, done, loop))
        s.remaining[:b] = torch.where(exits, 1.0, torch.where(run, remaining, s.remaining[:b]))
        s.position[:b] += exits
        generated = s.generated[:b] + exits
        s.generated[:b] = generated
        finished = exits & s.finishes(slice(0, b), drawn.token, generated)
        active.logical_and_(~finished)
        if not self.refill:
            parked.logical_or_(exits)

    def _exit_copies(self, b, exits, loop, block, offset, src) -> None:
        """LAST_EXITED: a token that exits after loop e lends its K/V (every layer) to each
        deeper plane, so later queries at loop d read version min(d, e)."""
        s, bs = self.s, self.kv.block_size
        deeper = s.block_tables[:b, 1:].gather(2, block[:, None, None].expand(b, self.depth - 1, 1))
        dst_own = deeper[:, :, 0].long() * bs + offset[:, None]
        wanted = exits[:, None] & (self.deeper[None, :] > loop[:, None])
        dst = torch.where(wanted, dst_own, self.kv.trash_slot)
        self.kv.copy_slots(src[:, None].expand_as(dst).flatten(), dst.flatten())

    def _record(self, b, exits, done, drawn) -> None:
        """Row `step` of the event buffers (a device counter: no host index in the graph)."""
        ev, t = self.ev, self.ev.step

        def put(buffer: torch.Tensor, values: torch.Tensor) -> None:
            buffer[:, :b].index_copy_(0, t, values[None])

        put(ev.token, torch.where(exits, drawn.token, -1))
        put(ev.depth, done)
        if drawn.logprob is not None:
            put(ev.logprob, drawn.logprob)
            n = drawn.top_ids.shape[1]
            if n:
                ev.top_ids[:, :b, :n].index_copy_(0, t, drawn.top_ids[None])
                ev.top_logprobs[:, :b, :n].index_copy_(0, t, drawn.top_logprobs[None])
        ev.step.add_(1)
