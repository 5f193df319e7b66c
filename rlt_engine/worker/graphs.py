"""CUDA graphs of the decode traversal: one per (padded batch size, static flags).

A traversal reads and writes only the slot batch, the KV pool and the event buffers (fixed
addresses), so replaying its graph N times is N traversals with no host work between them.
Batch sizes are padded up to 1, 2, 4, 8, ... (capped at the slot count); padded rows are idle
slots, which write to the trash slot and emit nothing. The common variants are captured when
the engine starts (`ModelRunner.capture_graphs`), the others on first use; either way the
warm-up run happens with every slot marked idle, so capturing never changes a request's state.
"""

from __future__ import annotations

import torch

from rlt_engine.worker.decode import DecodeTraversal, Flags


def bucket_sizes(num_slots: int) -> list[int]:
    sizes, b = [], 1
    while b < num_slots:
        sizes.append(b)
        b *= 2
    return [*sizes, num_slots]


class GraphCache:
    def __init__(self, traversal: DecodeTraversal, num_slots: int) -> None:
        self.traversal = traversal
        self.buckets = bucket_sizes(num_slots)
        self.graphs: dict[tuple[int, Flags], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def padded(self, b: int) -> int:
        return next(size for size in self.buckets if size >= b)

    def replay(self, b: int, flags: Flags, traversals: int) -> int:
        """Run `traversals` traversals over slots [0, padded b); returns the padded size."""
        b = self.padded(b)
        graph = self.ensure(b, flags)
        for _ in range(traversals):
            graph.replay()
        return b

    def ensure(self, b: int, flags: Flags) -> torch.cuda.CUDAGraph:
        """The graph of bucket `b` (a bucket size) with `flags`, captured if new."""
        graph = self.graphs.get((b, flags))
        if graph is None:
            graph = self.graphs[(b, flags)] = self._capture(b, flags)
        return graph

    def _capture(self, b: int, flags: Flags) -> torch.cuda.CUDAGraph:
        s, ev = self.traversal.s, self.traversal.ev
        saved = s.active.clone(), s.parked.clone(), ev.step.clone(), ev.token.clone()
        s.active.zero_()  # every slot idle: the warm-up writes only the trash slot
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile Triton kernels, settle cuBLAS workspaces
                self.traversal(b, flags)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.traversal(b, flags)
        for tensor, value in zip((s.active, s.parked, ev.step, ev.token), saved, strict=True):
            tensor.copy_(value)
        return graph
