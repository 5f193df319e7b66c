"""Prefill waves: several requests' prompt chunks through every loop, as one batch per loop.

On the Triton backend a wave of up to `MAX_GRAPH_ROWS` rows runs at a fixed shape: rows padded
up to a bucket (CUDA: 16, 32, ..., 512) and sequences to that bucket's count (`WaveBuckets`),
its inputs in one device buffer filled by one host-to-device copy. The shape depends only on
the row bucket (the attention's prefill grid is rows // block + sequences, however the rows
are cut into chunks), so the wave's `depth` traversals are one CUDA graph per row bucket, all
six captured at start-up, replayed with no host work between layers (eagerly launched, one
64-token prompt costs ~80 ms of Python launch overhead for ~3 ms of GPU work).
`--enforce-eager` runs the same padded function without capturing it, so graph = eager holds
by construction. Padded rows write only the trash slot and belong to the padding sequence,
which sees no keys; the sequences after it own no rows. On the CPU the same path runs at
smaller buckets (`CPU_BUCKETS`: no graphs there, and the interpreter pays for every row).

A larger wave runs as pieces of whole chunks, each at most `MAX_GRAPH_ROWS` rows and as many
chunks as the largest bucket has room for, through the same buckets: a wave holds one chunk
per sequence, and chunks of different sequences never read each other's keys, so the pieces
compute what the whole wave would. Launched eagerly, a 2,048-row wave (32 prompts of 64
tokens) took 71 ms of host time for 34 ms of GPU work on the H200; pieces of 512 rows keep the
GEMMs compute-bound. Only a chunk longer than the largest bucket (`--prefill-chunk-size` above
it), and the torch backend, run at their exact shape.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from rlt_engine.core.plan import PrefillChunk
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.worker.attention import PagedKVCache, PagedMetadata
from rlt_engine.worker.graphs import CaptureTally, capture
from rlt_engine.worker.slot_batch import SlotBatch, upload

MAX_GRAPH_ROWS = 512  # the largest bucket: a larger wave runs in pieces


@dataclass(frozen=True)
class WaveBuckets:
    """The fixed shapes of padded waves: their row counts, and a sequence per `rows_per_seq`
    rows (the padding one included), fixed by the row count so that a wave's shape (a CUDA
    graph's key) is its row bucket alone."""

    rows: tuple[int, ...]
    rows_per_seq: int

    def seqs(self, rows: int, num_slots: int) -> int:
        """Sequences of a padded wave of `rows` rows, the padding one (which owns the padded
        rows) included: at most one per slot and the padding one."""
        return min(num_slots + 1, rows // self.rows_per_seq + 1)

    def of(self, wave: WaveLayout, num_slots: int) -> int | None:
        """The padded rows of a wave: the smallest bucket with room for its rows and its
        chunks, or None where none has (more than `MAX_GRAPH_ROWS` rows, or chunks)."""
        chunks = len(wave.slots)
        return next(
            (b for b in self.rows if b >= wave.rows and self.seqs(b, num_slots) > chunks), None
        )


# CUDA: every bucket a captured graph. A chunk per 8 rows: each sequence adds one attention
# program per kv head to every replay, so not a chunk per row (a wave of many short chunks
# takes a larger bucket, or pieces).
CUDA_BUCKETS = WaveBuckets((16, 32, 64, 128, 256, 512), rows_per_seq=8)
# The CPU: no graphs, and the Triton backend runs under the interpreter (the tests), where a
# padded row costs what a real one does: the same padded path at small shapes.
CPU_BUCKETS = WaveBuckets((4, 8, 16, 32, 64, 128, 256, 512), rows_per_seq=2)


@dataclass(frozen=True)
class WaveLayout:
    """Host description of a wave: rows in chunk order."""

    ids: list[int]
    positions: list[int]
    row_seq: list[int]  # the chunk (sequence) each row belongs to
    slots: list[int]  # slot of each chunk
    counts: list[int]  # rows of each chunk
    ends: list[int]  # keys visible to each chunk's last row
    firsts: list[int]  # first row of each chunk, plus the row count at the end

    @classmethod
    def of(cls, wave: tuple[PrefillChunk, ...]) -> WaveLayout:
        counts = [len(c.token_ids) for c in wave]
        return cls(
            ids=[t for c in wave for t in c.token_ids],
            positions=[p for c in wave for p in range(c.start, c.start + len(c.token_ids))],
            row_seq=[i for i, n in enumerate(counts) for _ in range(n)],
            slots=[c.slot for c in wave],
            counts=counts,
            ends=[c.start + n for c, n in zip(wave, counts, strict=True)],
            firsts=list(itertools.accumulate(counts, initial=0)),
        )

    @property
    def rows(self) -> int:
        return len(self.ids)

    def piece(self, first: int, end: int) -> WaveLayout:
        """Chunks [first, end) as a wave of their own."""
        lo, hi = self.firsts[first], self.firsts[end]
        return WaveLayout(
            ids=self.ids[lo:hi],
            positions=self.positions[lo:hi],
            row_seq=[seq - first for seq in self.row_seq[lo:hi]],
            slots=self.slots[first:end],
            counts=self.counts[first:end],
            ends=self.ends[first:end],
            firsts=[f - lo for f in self.firsts[first : end + 1]],
        )

    def pieces(self, max_rows: int, max_chunks: int) -> list[WaveLayout]:
        """The wave cut between chunks into waves of at most `max_rows` rows and `max_chunks`
        chunks, in order (a chunk longer than `max_rows` is a piece alone)."""
        out, first = [], 0
        for end in range(1, len(self.counts) + 1):
            if (
                end == len(self.counts)
                or self.firsts[end + 1] - self.firsts[first] > max_rows
                or end + 1 - first > max_chunks
            ):
                out.append(self.piece(first, end))
                first = end
        return out

    @classmethod
    def empty(cls) -> WaveLayout:
        """No rows: uploaded at a bucket's shape, every row is padding (graph warm-ups)."""
        return cls([], [], [], [], [], [], [0])


@dataclass(frozen=True)
class WaveInputs:
    """A wave's rows on the device (padded to a bucket on the fixed-shape path)."""

    ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    row_seq: torch.Tensor  # [rows] int64: the sequence each row belongs to
    valid: torch.Tensor | None  # [rows] bool (fixed shapes: False on padding rows)
    slot: torch.Tensor  # [seqs] int64
    seq_len: torch.Tensor  # [seqs] int32: keys visible to each sequence's last row
    query_start: torch.Tensor  # [seqs + 1] int32
    max_query_len: int
    max_seq_len: int = 0  # host bounds for the torch backend (exact shapes only)
    chunks: tuple[tuple[int, int, int], ...] = ()

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])


class PrefillRunner:
    def __init__(
        self,
        model: LoopedCausalLM,
        kv: PagedKVCache,
        slots: SlotBatch,
        *,
        shared: bool,
        fixed_shapes: bool,
        graph_pool: tuple | None,
        tally: CaptureTally,
    ) -> None:
        """`fixed_shapes`: the Triton path (bucketed waves); `graph_pool`: capture them (CUDA
        graphs on), sharing the decode graphs' memory pool; `tally` counts the captures."""
        self.model, self.kv, self.s, self.tally = model, kv, slots, tally
        self.depth, self.shared = model.num_loops, shared
        self.fixed_shapes, self.pool = fixed_shapes, graph_pool
        self.max_rows = MAX_GRAPH_ROWS  # the rows of the largest piece (tests: smaller)
        self.num_slots = slots.num_slots
        self.buckets = CUDA_BUCKETS if slots.device.type == "cuda" else CPU_BUCKETS
        # one sequence more than the slots: the padding sequence that owns the padded rows
        n, s = MAX_GRAPH_ROWS, slots.num_slots + 1
        # one int64 buffer: ids, positions, row_seq, valid | slot, seq_len | query_start
        self._sizes = (n, n, n, n, s, s, s + 1)
        self.inputs = torch.zeros(sum(self._sizes), dtype=torch.long, device=slots.device)
        # the fields the kernels read as bool / int32, refreshed in place by each upload: a
        # captured traversal (a prefill graph, or a riding wave's inside a decode graph) reads
        # the same addresses at every replay, so no view here may be a fresh conversion
        self._valid = torch.zeros(n, dtype=torch.bool, device=slots.device)
        self._lens = torch.zeros(2 * s + 1, dtype=torch.int32, device=slots.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # by rows

    def __call__(self, wave: WaveLayout) -> torch.Tensor:
        """The last loop's hidden states, rows [0, wave.rows) in wave order (the tensor may
        have padding rows after them, and may be reused by the next wave)."""
        pieces = [wave]
        if self.fixed_shapes and (wave.rows > self.max_rows or len(wave.slots) > self.max_chunks):
            pieces = wave.pieces(self.max_rows, self.max_chunks)
        if len(pieces) == 1:
            return self._one(wave)
        hidden, start = None, 0
        for piece in pieces:
            out = self._one(piece)
            if hidden is None:
                hidden = out.new_empty(wave.rows, out.shape[1])
            # copied out (in stream order) before the next piece's replay reuses `out`
            hidden[start : start + piece.rows].copy_(out[: piece.rows])
            start += piece.rows
        assert hidden is not None
        return hidden

    @property
    def max_chunks(self) -> int:
        """The chunks of the largest piece: what its bucket has room for."""
        rows = next((b for b in self.buckets.rows if b >= self.max_rows), MAX_GRAPH_ROWS)
        return self.buckets.seqs(rows, self.num_slots) - 1

    def _one(self, wave: WaveLayout) -> torch.Tensor:
        rows = self.bucket(wave)
        if rows is None:
            return self._traverse(self.exact_inputs(wave))
        self.upload(wave, rows)
        if self.pool is None:
            return self._padded(rows)
        graph, out = self.graphs.get(rows) or self._capture(rows, wave)
        graph.replay()
        return out

    def bucket(self, wave: WaveLayout) -> int | None:
        """The padded rows of a fixed-shape wave, or None for an exact one."""
        if not self.fixed_shapes or wave.rows > self.max_rows:
            return None
        return self.buckets.of(wave, self.num_slots)

    def capture_buckets(self) -> int:
        """Capture every row bucket: every fixed-shape wave's graph, so that no wave waits
        for a capture once the engine serves; returns how many were new."""
        if self.pool is None:
            return 0
        new = [rows for rows in self.buckets.rows if rows not in self.graphs]
        for rows in new:
            self._capture(rows, WaveLayout.empty())
        return len(new)

    # -- the fixed-shape path --------------------------------------------------------------
    def upload(self, wave: WaveLayout, rows: int) -> None:
        """One copy of the wave's inputs. Rows [wave.rows, rows) are padding: they write the
        trash slot and belong to a padding sequence with no keys (so their attention output
        is exactly zero, and nothing in them overflows)."""
        r = wave.rows
        host = torch.zeros(sum(self._sizes), dtype=torch.long)
        ids, positions, row_seq, valid, slot, seq_len, query_start = host.split(self._sizes)
        ids[:r] = torch.tensor(wave.ids)
        positions[:r] = torch.tensor(wave.positions)
        row_seq[:r] = torch.tensor(wave.row_seq)
        valid[:r] = 1
        k = len(wave.slots)
        slot[:k] = torch.tensor(wave.slots)
        seq_len[:k] = torch.tensor(wave.ends)
        query_start[: k + 1] = torch.tensor(wave.firsts)
        query_start[k + 1 :] = rows  # sequence k (seq_len 0) owns the padded rows
        self.inputs.copy_(upload(host, self.inputs.device))
        self._valid.copy_(self.inputs.split(self._sizes)[3])
        self._lens.copy_(self.inputs[-self._lens.numel() :])  # seq_len | query_start

    def inputs_for(self, wave: WaveLayout) -> WaveInputs:
        """The wave's rows on the device, at a bucket's shape where one fits (a wave riding in
        the decode traversals, worker/decode.py)."""
        rows = self.bucket(wave)
        if rows is None:
            return self.exact_inputs(wave)
        self.upload(wave, rows)
        return self._padded_inputs(rows)

    def empty_inputs(self, rows: int) -> WaveInputs:
        """Bucket `rows` with every row padding (a riding graph's capture runs it)."""
        self.upload(WaveLayout.empty(), rows)
        return self._padded_inputs(rows)

    def _padded_inputs(self, rows: int) -> WaveInputs:
        seqs = self.buckets.seqs(rows, self.num_slots)
        ids, positions, row_seq, _, slot, _, _ = self.inputs.split(self._sizes)
        seq_len, query_start = self._lens.split(self._sizes[5:])
        return WaveInputs(
            ids[:rows],
            positions[:rows],
            row_seq[:rows],
            self._valid[:rows],
            slot[:seqs],
            seq_len[:seqs],
            query_start[: seqs + 1],
            max_query_len=rows,
        )

    def _padded(self, rows: int) -> torch.Tensor:
        return self._traverse(self._padded_inputs(rows))

    def _capture(self, rows: int, wave: WaveLayout) -> tuple:
        """Capture bucket `rows`, then put `wave`'s inputs back. The warm-up run sees
        an empty wave (every row padding): it writes only the trash slot."""
        self.upload(WaveLayout.empty(), rows)
        with self.tally.timing():
            graph, out = capture(lambda: self._padded(rows), self.pool)
        self.graphs[rows] = graph, out
        self.upload(wave, rows)
        return graph, out

    # -- the exact-shape path --------------------------------------------------------------
    def _exact(self, wave: WaveLayout) -> torch.Tensor:
        return self._traverse(self.exact_inputs(wave))

    def exact_inputs(self, wave: WaveLayout) -> WaveInputs:
        dev = self.s.device
        rows = torch.tensor([wave.ids, wave.positions, wave.row_seq])
        ids, positions, row_seq = upload(rows, dev)
        lens = torch.tensor([wave.ends, wave.firsts[1:]], dtype=torch.int32)
        seq_len, ends = upload(lens, dev)
        query_start = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev), ends])
        return WaveInputs(
            ids,
            positions,
            row_seq,
            None,
            upload(torch.tensor(wave.slots), dev),
            seq_len,
            query_start,
            max_query_len=max(wave.counts),
            max_seq_len=max(wave.ends),
            chunks=tuple(zip(wave.firsts[:-1], wave.counts, wave.ends, strict=True)),
        )

    # -- one wave through every loop -------------------------------------------------------
    def _traverse(self, wave: WaveInputs) -> torch.Tensor:
        hidden = self.model.prelude(wave.ids)
        for loop in range(self.depth):
            loops = torch.full_like(wave.positions, loop)
            hidden = self.model.recurrent(hidden, self.metadata(wave, loops), self.kv).hidden
        return hidden

    def metadata(self, wave: WaveInputs, loops: torch.Tensor) -> PagedMetadata:
        """The wave's attention metadata at the loop in `loops` ([rows] int64, every entry
        the same loop: a host constant, or the window's traversal counter on the device)."""
        bs = self.kv.block_size
        plane = torch.zeros_like(loops[:1]) if self.shared else loops[:1]
        tables = self.s.block_tables[wave.slot].index_select(1, plane)[:, 0]
        positions = wave.positions
        own = tables[wave.row_seq, positions // bs].long() * bs + positions % bs
        if wave.valid is not None:
            own = torch.where(wave.valid, own, self.kv.trash_slot)
        return PagedMetadata(
            positions=positions,
            loop_indices=loops,
            slot_mapping=own,
            block_tables=tables,
            seq_lens=wave.seq_len,
            query_start=wave.query_start,
            max_query_len=wave.max_query_len,
            max_seq_len=wave.max_seq_len,
            chunks=wave.chunks,
        )
