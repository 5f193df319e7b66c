"""CUDA graphs of the decode traversal: one per (padded batch size, static flags), and one
per (padded batch size, flags, riding wave shape) for the traversals a prefill wave rides.

A traversal reads and writes only the slot batch, the KV pool and the event buffers (fixed
addresses), so replaying its graph N times is N traversals with no host work between them.
Batch sizes are padded up to 1, 2, 4, 8, ... (capped at the slot count); padded rows are idle
slots, which write to the trash slot and emit nothing. The common variants are captured when
the engine starts (`ModelRunner.capture_graphs`), the others on first use; either way the
warm-up run happens with every slot marked idle, so capturing never changes a request's state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

import torch

from rlt_engine.worker.decode import DecodeTraversal, Flags, RidingWave

# Eager runs before a capture, on a side stream: the first call of each kernel shape compiles
# its Triton kernel and loads the module, which CUDA does not allow while a stream captures.
# One run does that.
WARMUP_RUNS = 1


def capture(
    run: Callable[[], object], pool: tuple, warm: Callable[[], object] | None = None
) -> tuple:
    """(graph, run's output in the graph's memory): `warm` (by default `run`) eagerly
    WARMUP_RUNS times, then `run` captured into `pool` (a `torch.cuda.graph_pool_handle()`).

    Not `torch.cuda.graph(...)`: on entry it synchronises the device and empties the caching
    allocator and the pinned host cache, so every capture of a start-up that takes a hundred
    waited for the GPU and then allocated its warm-up's memory again with cudaMalloc. The
    caller empties the cache once when it is done (`ModelRunner.capture_graphs`)."""
    stream = _capture_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_RUNS):
            (warm or run)()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool)
        try:
            out = run()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out


@cache
def _capture_stream(device: int) -> torch.cuda.Stream:
    """One side stream for every capture on a device. The caching allocator hands a freed
    block only to its own stream, so a stream per capture stranded each warm-up's memory (the
    sampler's [slots, vocab] words at 256 slots: hundreds of MB) until the caller emptied the
    cache: 258 start-up graphs ran an H100 out of memory after the KV pool was sized."""
    return torch.cuda.Stream(device)


def bucket_sizes(num_slots: int) -> list[int]:
    sizes, b = [], 1
    while b < num_slots:
        sizes.append(b)
        b *= 2
    return [*sizes, num_slots]


@dataclass
class CaptureTally:
    """CUDA graphs captured so far and the host seconds they took (their warm-up runs
    included). A capture after start-up is a stall that every request in flight waits
    through, so the engine reports both (`EngineStats`, `/metrics`, `rlt bench`)."""

    graphs: int = 0
    seconds: float = 0.0

    @contextmanager
    def timing(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.graphs += 1
        self.seconds += time.perf_counter() - start


class GraphCache:
    def __init__(self, traversal: DecodeTraversal, num_slots: int, tally: CaptureTally) -> None:
        self.traversal, self.tally = traversal, tally
        self.buckets = bucket_sizes(num_slots)
        # (padded B, flags, riding wave variant or None) -> graph
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def padded(self, b: int) -> int:
        return next(size for size in self.buckets if size >= b)

    def replay(self, b: int, flags: Flags, traversals: int, wave: RidingWave | None = None) -> int:
        """Run `traversals` traversals over slots [0, padded b), the first `depth` with
        `wave` riding (a fixed-shape wave, its graph already captured); returns the padded
        size."""
        b = self.padded(b)
        # captured before the window's first replay: a capture's warm-up writes event rows
        # 0 and 1, which the window's own traversals then overwrite
        graph = self.ensure(b, flags)
        riding = 0 if wave is None else self.traversal.depth
        for _ in range(riding):
            self.graphs[(b, flags, wave.key)].replay()  # type: ignore[union-attr]
        for _ in range(traversals - riding):
            graph.replay()
        return b

    def captured(self, b: int, flags: Flags, wave: RidingWave | None = None) -> bool:
        return (self.padded(b), flags, None if wave is None else wave.key) in self.graphs

    def ensure(self, b: int, flags: Flags, wave: RidingWave | None = None) -> torch.cuda.CUDAGraph:
        """The graph of bucket `b` (a bucket size) with `flags` (and `wave` riding), captured
        if new. A riding wave's inputs must be an empty (all padding) wave while it is
        captured: the warm-up run executes it."""
        key = (b, flags, None if wave is None else wave.key)
        graph = self.graphs.get(key)
        if graph is None:
            with self.tally.timing():
                graph = self.graphs[key] = self._capture(b, flags, wave)
        return graph

    def _capture(self, b: int, flags: Flags, wave: RidingWave | None) -> torch.cuda.CUDAGraph:
        s, ev = self.traversal.s, self.traversal.ev
        saved = s.active.clone(), s.parked.clone(), ev.step.clone(), ev.token.clone()
        armed = None if wave is None else wave.armed.clone()
        s.active.zero_()  # every slot idle: the warm-up writes only the trash slot
        if wave is not None:
            wave.armed.zero_()  # and starts no slot decoding

        def warm() -> None:
            if wave is not None:
                ev.step.zero_()  # the wave's loop: a plane that exists
            self.traversal(b, flags, wave)

        graph, _ = capture(lambda: self.traversal(b, flags, wave), self.pool, warm)
        for tensor, value in zip((s.active, s.parked, ev.step, ev.token), saved, strict=True):
            tensor.copy_(value)
        if wave is not None:
            wave.armed.copy_(armed)
        return graph
