"""The collector settings of a long-lived engine or server process (rlt_engine/heap.py). The
conftest gives the test process its collector back after each test."""

from __future__ import annotations

import gc
import weakref

from rlt_engine.heap import YOUNG_THRESHOLD, freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cycle collector frees it


def test_freeze_startup_heap_freezes_what_is_alive() -> None:
    alive = _Node()
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() > 0
    assert gc.get_threshold()[0] == YOUNG_THRESHOLD
    assert not any(obj is alive for obj in gc.get_objects())  # frozen: never walked again
    del alive


def test_a_second_call_collects_what_the_first_froze() -> None:
    """An engine dropped after a freeze is not uncollectable for good: the next call (the
    next engine's) unfreezes, collects, then freezes."""
    node = _Node()
    dropped = weakref.ref(node)
    freeze_startup_heap()
    del node
    gc.collect()
    assert dropped() is not None  # frozen: even a full collection leaves it
    freeze_startup_heap()
    assert dropped() is None


def test_garbage_from_before_the_freeze_is_collected_first() -> None:
    node = _Node()
    dropped = weakref.ref(node)
    del node
    freeze_startup_heap()
    assert dropped() is None
