"""The depth-aware block pool: per-plane tables, lifetime reservation, slot arithmetic."""

from __future__ import annotations

import random

import pytest

from rlt_engine.core.block_manager import BlockManager


def test_blocks_needed_counts_every_plane():
    bm = BlockManager(num_blocks=40, block_size=4, num_planes=3)
    assert bm.blocks_needed(1) == 3
    assert bm.blocks_needed(4) == 3
    assert bm.blocks_needed(5) == 6
    assert bm.blocks_needed(13) == 12
    assert bm.can_ever_fit(52) and not bm.can_ever_fit(53)  # 13 per plane x 3 = 39 <= 40


def test_allocate_gives_one_disjoint_table_per_plane_and_free_returns_all():
    bm = BlockManager(num_blocks=20, block_size=2, num_planes=4)
    tables, _ = bm.allocate("a", 5)  # 3 blocks per plane
    assert len(tables) == 4 and all(len(t) == 3 for t in tables)
    flat = [b for t in tables for b in t]
    assert len(set(flat)) == 12 and all(0 <= b < 20 for b in flat)
    assert bm.num_used == 12 and bm.num_free == 8
    other, _ = bm.allocate("b", 4)
    assert not set(flat) & {b for t in other for b in t}
    assert bm.num_used == 20 and not bm.can_allocate(1)
    bm.free("a")
    bm.free("b")
    assert bm.num_used == 0 and bm.num_free == 20


def test_allocation_errors_and_idempotent_free():
    bm = BlockManager(num_blocks=8, block_size=4, num_planes=2)
    bm.allocate("a", 8)  # 2 per plane = 4
    with pytest.raises(RuntimeError, match="already holds"):
        bm.allocate("a", 1)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate("b", 9)  # 3 per plane = 6 > 4 free
    assert bm.num_used == 4  # a failed allocation takes nothing
    bm.free("a")
    bm.free("a")  # freeing twice (or an unknown owner) is a no-op
    bm.free("nobody")
    assert bm.num_used == 0 and bm.num_free == 8


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_slot_maps_positions_through_the_table(block_size):
    bm = BlockManager(num_blocks=64, block_size=block_size, num_planes=2)
    bm.allocate("filler", 2 * block_size + 1)  # make the next tables non-trivial
    tables, _ = bm.allocate("a", 3 * block_size)
    for table in tables:
        slots = [bm.slot(table, p) for p in range(3 * block_size)]
        assert len(set(slots)) == len(slots)
        for p, s in enumerate(slots):
            assert s // block_size == table[p // block_size]
            assert s % block_size == p % block_size
    # planes never share a slot
    plane_slots = [{bm.slot(t, p) for p in range(3 * block_size)} for t in tables]
    assert not plane_slots[0] & plane_slots[1]


def test_random_allocate_free_conserves_blocks():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=50, block_size=3, num_planes=4)
    live: dict[str, list[list[int]]] = {}
    for i in range(300):
        if live and rng.random() < 0.45:
            owner = rng.choice(sorted(live))
            bm.free(owner)
            del live[owner]
        else:
            n = rng.randint(1, 12)
            if bm.can_allocate(n):
                live[f"r{i}"] = bm.allocate(f"r{i}", n)[0]
            else:
                with pytest.raises(RuntimeError, match="out of KV blocks"):
                    bm.allocate(f"r{i}", n)
        held = [b for tables in live.values() for t in tables for b in t]
        assert len(held) == len(set(held)) == bm.num_used
        assert bm.num_used + bm.num_free == 50
    for owner in list(live):
        bm.free(owner)
    assert bm.num_used == 0
