"""The garbage collector of a process that keeps one engine, or one API server, for its life.

CPython's cyclic collector runs a young collection every 700 net new container objects and,
every so often, a full one that walks every object alive: torch, the model, the tokenizer,
FastAPI. Serving at c=256 on this project's 2-core CPU
(benchmarks/results/2026-12-05-gc-cpu.md), an API server paused 100-160 ms for each full
collection and spent ~10 us per streamed token collecting; the engine process paused
~100 ms, a window the GPU would wait through. Two changes make it ~0:

- after startup, one collection and `gc.freeze()`: what startup made is never walked again;
- young collections every 10,000 net new objects instead of 700: a step's outputs, chunks
  and metrics come and go between two collections instead of being walked and promoted
  into the older generations (the promotions are what triggered the full collections).

Only for a process that keeps what it has loaded: an engine dropped after the freeze is not
collected by the cycle collector (if it holds reference cycles) until the next
`freeze_startup_heap()`. The library (`LLM`, `AsyncEngine` on a thread) leaves the
collector alone; `rlt serve`'s engine and API server processes and the CLI's in-process
engines call this once they are ready.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000  # net new container objects between young collections (CPython: 700)


def freeze_startup_heap() -> int:
    """Collect, freeze what is alive, and space the young collections; returns how many
    objects are frozen. Calling it again first unfreezes (so nothing stays frozen for good)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
    return gc.get_freeze_count()
