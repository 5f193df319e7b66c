"""Prefill waves: several requests' prompt chunks through every loop, as one batch per loop.

On the Triton backend a wave of up to `MAX_GRAPH_ROWS` rows runs at a fixed shape: rows padded
up to a bucket (16, 32, ..., 512) and sequences up to a power of two, its inputs in one device
buffer filled by one host-to-device copy. The shape depends only on the bucket, so the wave's
`depth` traversals are one CUDA graph per bucket, replayed with no host work between layers
(eagerly launched, one 64-token prompt costs ~80 ms of Python launch overhead for ~3 ms of GPU
work). `--enforce-eager` runs the same padded function without capturing it, so graph = eager
holds by construction. Padded rows write only the trash slot and belong to no sequence; padded
sequences own no rows.

A larger wave runs as pieces of whole chunks, each at most `MAX_GRAPH_ROWS` rows, through the
same buckets: a wave holds one chunk per sequence, and chunks of different sequences never
read each other's keys, so the pieces compute what the whole wave would. Launched eagerly, a
2,048-row wave (32 prompts of 64 tokens) took 71 ms of host time for 34 ms of GPU work on the
H200; pieces of 512 rows keep the GEMMs compute-bound. Only a chunk longer than the largest
bucket (`--prefill-chunk-size` above it), and the torch backend, run at their exact shape.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from rlt_engine.core.plan import PrefillChunk
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.worker.attention import PagedKVCache, PagedMetadata
from rlt_engine.worker.graphs import CaptureTally, bucket_sizes
from rlt_engine.worker.slot_batch import SlotBatch, upload

ROW_BUCKETS = (16, 32, 64, 128, 256, 512)
MAX_GRAPH_ROWS = ROW_BUCKETS[-1]


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

    def pieces(self, max_rows: int) -> list[WaveLayout]:
        """The wave cut between chunks into waves of at most `max_rows` rows, in order (a
        chunk longer than that is a piece alone)."""
        out, first = [], 0
        for end in range(1, len(self.counts) + 1):
            if end == len(self.counts) or self.firsts[end + 1] - self.firsts[first] > max_rows:
                out.append(self.piece(first, end))
                first = end
        return out

    @classmethod
    def empty(cls) -> WaveLayout:
        """No rows: uploaded at a bucket's shape, every row is padding (graph warm-ups)."""
        return cls([], [], [], [], [], [], [0])


def wave_bucket(wave: WaveLayout, seq_buckets: list[int]) -> tuple[int, int]:
    """(padded rows, padded sequences) of a wave of at most `MAX_GRAPH_ROWS` rows: its graph's
    shape. One sequence more than the wave's: the padding one that owns the padded rows."""
    rows = next(b for b in ROW_BUCKETS if b >= wave.rows)
    return rows, next(b for b in seq_buckets if b >= len(wave.slots) + 1)


def single_sequence_buckets(seq_buckets: list[int]) -> list[tuple[int, int]]:
    """The buckets of one sequence's wave at every row bucket: captured at start-up."""
    return [(rows, next(b for b in seq_buckets if b >= 2)) for rows in ROW_BUCKETS]


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
        self.max_rows = MAX_GRAPH_ROWS  # the largest bucket a wave takes (tests: smaller)
        # one sequence more than the slots: the padding sequence that owns the padded rows
        self.seq_buckets = bucket_sizes(slots.num_slots + 1)
        n, s = MAX_GRAPH_ROWS, slots.num_slots + 1
        # one int64 buffer: ids, positions, row_seq, valid | slot, seq_len | query_start
        self._sizes = (n, n, n, n, s, s, s + 1)
        self.inputs = torch.zeros(sum(self._sizes), dtype=torch.long, device=slots.device)
        # the fields the kernels read as bool / int32, refreshed in place by each upload: a
        # captured traversal (a prefill graph, or a riding wave's inside a decode graph) reads
        # the same addresses at every replay, so no view here may be a fresh conversion
        self._valid = torch.zeros(n, dtype=torch.bool, device=slots.device)
        self._lens = torch.zeros(2 * s + 1, dtype=torch.int32, device=slots.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def __call__(self, wave: WaveLayout) -> torch.Tensor:
        """The last loop's hidden states, rows [0, wave.rows) in wave order (the tensor may
        have padding rows after them, and may be reused by the next wave)."""
        pieces = [wave]
        if self.fixed_shapes and wave.rows > self.max_rows:
            pieces = wave.pieces(self.max_rows)
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

    def _one(self, wave: WaveLayout) -> torch.Tensor:
        bucket = self.bucket(wave)
        if bucket is None:
            return self._traverse(self.exact_inputs(wave))
        self.upload(wave, bucket[0])
        if self.pool is None:
            return self._traverse(self._padded_inputs(*bucket))
        graph, out = self.graphs.get(bucket) or self._capture(*bucket, wave)
        graph.replay()
        return out

    def bucket(self, wave: WaveLayout) -> tuple[int, int] | None:
        """(padded rows, padded sequences) of a fixed-shape wave, or None for an exact one."""
        if not self.fixed_shapes or wave.rows > self.max_rows:
            return None
        return wave_bucket(wave, self.seq_buckets)

    def capture_single_sequence(self) -> int:
        """Capture every row bucket for one sequence (the wave of a lone arrival, where a
        first capture would be the request's whole wait); returns how many were new."""
        if self.pool is None:
            return 0
        empty = WaveLayout.empty()
        new = 0
        for bucket in single_sequence_buckets(self.seq_buckets):
            if bucket not in self.graphs:
                self._capture(*bucket, empty)
                new += 1
        return new

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
        bucket = self.bucket(wave)
        if bucket is None:
            return self.exact_inputs(wave)
        self.upload(wave, bucket[0])
        return self._padded_inputs(*bucket)

    def _padded_inputs(self, rows: int, seqs: int) -> WaveInputs:
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

    def _padded(self, rows: int, seqs: int) -> torch.Tensor:
        return self._traverse(self._padded_inputs(rows, seqs))

    def _capture(self, rows: int, seqs: int, wave: WaveLayout) -> tuple:
        """Capture bucket (rows, seqs), then put `wave`'s inputs back. The warm-up runs see
        an empty wave (every row padding): they write only the trash slot."""
        self.upload(WaveLayout.empty(), rows)
        with self.tally.timing():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile the Triton kernels, settle cuBLAS workspaces
                    self._padded(rows, seqs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._padded(rows, seqs)
        self.graphs[(rows, seqs)] = graph, out
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
