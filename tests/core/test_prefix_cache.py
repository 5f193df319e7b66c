"""The block manager's prefix cache, pure Python: exact chained keys, one physical block per
plane, reference counts, LRU eviction only when a claim can succeed, `commit_prefix`, stats.

A cacheable block is a FULL prompt block that does not hold the prompt's last token (that
position's hidden state is needed for the first output token, so it is always computed).
"""

from __future__ import annotations

import random

import pytest

from rlt_engine.core.block_manager import BlockManager

BS = 2  # block size of most tests
PLANES = 3


def make(num_blocks: int = 60, planes: int = PLANES, block_size: int = BS) -> BlockManager:
    return BlockManager(num_blocks, block_size, planes, prefix_caching=True)


def prefill(bm: BlockManager, owner: str, prompt: list[int], extra: int = 0) -> int:
    """Allocate for the prompt (+ `extra` positions), publish it as fully prefilled; returns
    the number of cached leading tokens the allocation reused."""
    _, cached = bm.allocate(owner, len(prompt) + extra, prompt)
    bm.commit_prefix(owner, prompt, len(prompt))
    return cached


def run_once(bm: BlockManager, owner: str, prompt: list[int]) -> int:
    cached = prefill(bm, owner, prompt)
    bm.free(owner)
    return cached


def probe(bm: BlockManager, prompt: list[int]) -> int:
    """Cached leading tokens a request with this prompt would reuse (publishes nothing)."""
    _, cached = bm.allocate("probe", len(prompt), prompt)
    bm.free("probe")
    return cached


def owned(bm: BlockManager, owner: str) -> set[int]:
    return {b for t in bm.owned_blocks(owner) for b in t}


# -- which blocks are cacheable --------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_len", "reusable_blocks"),
    [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2), (6, 2), (7, 3), (8, 3)],
)
def test_the_block_holding_the_last_prompt_token_is_never_cached(prompt_len, reusable_blocks):
    bm = make()
    prompt = list(range(100, 100 + prompt_len))
    assert run_once(bm, "a", prompt) == 0
    # the same prompt again: every full block except the one with the last token is reused
    assert run_once(bm, "b", prompt) == reusable_blocks * BS
    assert bm.stats.hit_blocks == reusable_blocks
    # a prompt of exactly k full blocks reuses k - 1 of them
    if prompt_len % BS == 0:
        assert reusable_blocks == prompt_len // BS - 1
    assert bm.num_used == 0


def test_a_longer_prompt_with_the_same_prefix_reuses_the_published_blocks():
    bm = make()
    base = list(range(100, 107))  # 7 tokens: blocks [0,1] [2,3] [4,5] published
    run_once(bm, "a", base)
    assert run_once(bm, "b", [*base, 7, 8, 9]) == 6
    # b published its own further blocks ([6, 7] holds base[6] and 7; [8, 9] holds the last)
    assert run_once(bm, "c", [*base, 7, 8, 9, 10]) == 8


# -- exact chained keys ----------------------------------------------------------------------


def test_keys_chain_over_the_whole_prefix():
    bm = make()
    run_once(bm, "a", [1, 2, 3, 4, 5, 6, 7])
    # the same second and third blocks after a different first block: no hit at all
    assert run_once(bm, "b", [9, 9, 3, 4, 5, 6, 7]) == 0
    # diverging in the second block: only the first block hits
    assert run_once(bm, "c", [1, 2, 3, 0, 5, 6, 7]) == BS
    # one token different in the first block: nothing
    assert run_once(bm, "d", [1, 0, 3, 4, 5, 6, 7]) == 0
    # identical prefix: all three cacheable blocks
    assert run_once(bm, "e", [1, 2, 3, 4, 5, 6, 7, 8]) == 3 * BS


def test_a_hit_shares_one_physical_block_per_plane():
    bm = make()
    prompt = [1, 2, 3, 4, 5, 6, 7]
    tables_a, _ = bm.allocate("a", 9, prompt)
    bm.commit_prefix("a", prompt, len(prompt))
    tables_b, cached = bm.allocate("b", 8, prompt)
    assert cached == 6
    for plane in range(PLANES):
        assert tables_b[plane][:3] == tables_a[plane][:3]  # shared prefix blocks
        assert not set(tables_b[plane][3:]) & set(tables_a[plane])  # private tails
    # the planes of one cached entry are distinct blocks
    assert len({tables_a[p][0] for p in range(PLANES)}) == PLANES
    # shared blocks are counted once: a holds 5 per plane, b adds 1 private per plane
    assert bm.num_used == PLANES * 5 + PLANES * 1
    bm.free("a")
    assert bm.num_used == PLANES * 4  # b still references the 3 shared blocks
    bm.free("b")
    assert bm.num_used == 0 and bm.num_free == bm.num_blocks


# -- reference counts and LRU ----------------------------------------------------------------


def test_refcounted_entries_survive_until_the_last_user_frees_them():
    bm = make(num_blocks=3 * PLANES * 2)  # room for 6 blocks per plane
    prompt = [1, 2, 3, 4, 5]  # 2 cacheable blocks, 3 per plane in all
    prefill(bm, "a", prompt)
    assert prefill(bm, "b", prompt) == 4
    bm.free("a")
    # b still holds the shared entries: they are neither free nor evictable
    assert bm.num_free == bm.num_blocks - PLANES * 2 - PLANES * 1  # 3 blocks per plane left
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate("big", 4 * BS)  # fits only if the referenced entries were evictable
    bm.free("b")
    assert bm.num_used == 0
    assert run_once(bm, "c", prompt) == 4  # still cached after both freed


def test_lru_evicts_the_least_recently_released_entry_first():
    # 4 blocks per plane; each prompt below publishes exactly one entry (one block per plane)
    bm = make(num_blocks=4 * PLANES)
    a, b, c = [1, 2, 3], [4, 5, 6], [7, 8, 9]
    for owner, prompt in (("a", a), ("b", b), ("c", c)):
        run_once(bm, owner, prompt)
    run_once(bm, "a2", a)  # a is used again: now b is the oldest released entry
    assert bm.num_used == 0 and bm.num_free == bm.num_blocks
    # a fresh request taking 2 blocks per plane: one is free, the other evicts the oldest (b)
    bm.allocate("x", 2 * BS)
    bm.free("x")
    assert run_once(bm, "b2", b) == 0  # evicted (and b2 republishes it)
    assert run_once(bm, "c2", c) == BS
    assert run_once(bm, "a3", a) == BS


def test_a_hit_on_an_unreferenced_entry_takes_it_out_of_the_lru():
    bm = make(num_blocks=2 * PLANES)  # 2 blocks per plane
    prompt = [1, 2, 3]  # one cacheable block
    run_once(bm, "a", prompt)
    # the entry is unreferenced (evictable) but this very allocation hits it: it needs one
    # fresh block per plane besides, which exists; nothing may be evicted
    _, cached = bm.allocate("b", 3, prompt)
    assert cached == BS and bm.num_used == bm.num_blocks
    bm.free("b")
    assert run_once(bm, "c", prompt) == BS


def test_eviction_happens_only_when_the_claim_can_succeed():
    bm = make(num_blocks=4 * PLANES)
    run_once(bm, "a", [1, 2, 3, 4, 5])  # 2 entries, now unreferenced
    bm.allocate("x", 2 * BS)  # the 2 free blocks per plane
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate("y", 3 * BS)  # 3 per plane > 2 evictable: must not touch the cache
    assert not bm.grow("x", 5 * BS)  # growth by 3 per plane fails the same way
    assert bm.capacity("x") == 2 * BS
    bm.free("x")
    assert run_once(bm, "a2", [1, 2, 3, 4, 5]) == 2 * BS  # both entries survived
    # growth that can succeed evicts as needed
    bm.allocate("z", 2 * BS)
    assert bm.grow("z", 4 * BS) and bm.num_free == 0
    bm.free("z")
    assert run_once(bm, "a3", [1, 2, 3, 4, 5]) == 0


def test_unreferenced_cached_blocks_count_as_free():
    bm = make(num_blocks=4 * PLANES)
    run_once(bm, "a", [1, 2, 3, 4, 5])
    assert bm.num_used == 0 and bm.num_free == bm.num_blocks
    assert bm.can_allocate(4 * BS)
    tables, cached = bm.allocate("b", 4 * BS)  # no prompt: evicts both entries
    assert cached == 0 and bm.num_free == 0
    assert len({b for t in tables for b in t}) == bm.num_blocks


# -- commit_prefix ---------------------------------------------------------------------------


def test_commit_publishes_only_blocks_final_on_every_plane():
    bm = make()
    prompt = list(range(1, 10))  # 9 tokens: 4 cacheable blocks
    bm.allocate("a", 12, prompt)
    bm.commit_prefix("a", prompt, 3)  # one chunk of 3 finished every loop: block 0 only
    assert probe(bm, prompt) == BS
    bm.commit_prefix("a", prompt, 7)  # blocks 1, 2
    assert probe(bm, prompt) == 3 * BS
    bm.commit_prefix("a", prompt, 9)  # block 3 (block 4 holds the last token: never)
    bm.commit_prefix("a", prompt, 9)  # idempotent
    assert probe(bm, prompt) == 4 * BS
    bm.free("a")
    assert bm.num_used == 0
    assert probe(bm, prompt) == 4 * BS


def test_first_publisher_wins_and_the_second_keeps_its_private_blocks():
    bm = make()
    prompt = [1, 2, 3, 4, 5]
    ta, _ = bm.allocate("a", 5, prompt)
    tb, _ = bm.allocate("b", 5, prompt)  # concurrent: nothing published yet
    bm.commit_prefix("a", prompt, 5)
    bm.commit_prefix("b", prompt, 5)  # same keys: b does not replace a's entries
    tc, cached = bm.allocate("c", 5, prompt)
    assert cached == 4
    assert [t[:2] for t in tc] == [t[:2] for t in ta]
    bm.free("b")  # b's blocks go straight back to the free list
    bm.free("a")
    bm.free("c")
    assert bm.num_used == 0 and bm.num_free == bm.num_blocks
    assert not {b for t in tb for b in t} & {b for t in tc for b in t}


def test_commit_and_lookup_are_no_ops_without_prefix_caching():
    bm = BlockManager(40, BS, PLANES)
    prompt = [1, 2, 3, 4, 5]
    bm.allocate("a", 5, prompt)
    bm.commit_prefix("a", prompt, 5)
    bm.free("a")
    _, cached = bm.allocate("b", 5, prompt)
    assert cached == 0 and bm.stats.queried_blocks == 0
    bm.commit_prefix("nobody", prompt, 5)  # unknown owners are ignored


# -- statistics ------------------------------------------------------------------------------


def test_stats_count_queried_and_hit_blocks():
    bm = make()
    assert bm.stats.hit_rate == 0.0  # nothing queried yet
    run_once(bm, "a", [1, 2, 3, 4, 5, 6, 7])  # 3 queried, 0 hits
    run_once(bm, "b", [1, 2, 3, 4, 9, 9, 9])  # 3 queried, 2 hits
    run_once(bm, "c", [1, 2, 3])  # 1 queried, 1 hit
    run_once(bm, "d", [1])  # nothing cacheable: 0 queried
    assert (bm.stats.queried_blocks, bm.stats.hit_blocks) == (7, 3)
    assert bm.stats.hit_rate == pytest.approx(3 / 7)


def test_a_failed_allocation_does_not_count_in_the_stats():
    # a request waiting for memory retries its claim every step: only real claims count
    bm = make(num_blocks=4 * PLANES)
    prompt = [1, 2, 3, 4, 5]
    run_once(bm, "a", prompt)  # 2 queried, 0 hits
    bm.allocate("x", 2 * BS)
    before = (bm.stats.queried_blocks, bm.stats.hit_blocks)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate("b", 6 * BS, prompt)  # needs 4 fresh blocks per plane, 2 exist
    assert (bm.stats.queried_blocks, bm.stats.hit_blocks) == before


# -- randomized conservation -----------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_conserves_blocks_and_reuses_exact_prefixes(seed):
    rng = random.Random(seed)
    planes, bs = rng.choice([1, 2, 4]), rng.choice([1, 2, 3])
    bm = make(num_blocks=planes * rng.randint(8, 20), planes=planes, block_size=bs)
    bases = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live: dict[str, list[int]] = {}
    published: set[tuple[int, ...]] = set()  # full-prefix token tuples ever published
    for i in range(300):
        if live and rng.random() < 0.45:
            owner = rng.choice(sorted(live))
            bm.free(owner)
            del live[owner]
        else:
            base = rng.choice(bases)
            tail = [rng.randrange(50) for _ in range(rng.randint(1, 4))]
            prompt = [*base[: rng.randint(0, 12)], *tail]
            tokens = len(prompt) + rng.randint(0, 4)
            owner = f"r{i}"
            used_before = bm.num_used
            try:
                _, cached = bm.allocate(owner, tokens, prompt)
            except RuntimeError:
                assert bm.num_used == used_before  # a failed claim takes nothing
                assert not bm.can_allocate(tokens)
            else:
                assert cached % bs == 0 and cached <= len(prompt) - 1
                # every reused block was published with exactly this whole prefix
                for end in range(bs, cached + 1, bs):
                    assert tuple(prompt[:end]) in published
                done = rng.choice([cached, len(prompt)])
                bm.commit_prefix(owner, prompt, done)
                for end in range(bs, min(done, len(prompt) - 1) + 1, bs):
                    published.add(tuple(prompt[:end]))
                live[owner] = prompt
        in_tables = set().union(*(owned(bm, o) for o in live)) if live else set()
        assert len(in_tables) == bm.num_used
        assert 0 <= bm.num_used <= bm.num_blocks
    for owner in list(live):
        bm.free(owner)
    assert bm.num_used == 0 and bm.num_free == bm.num_blocks
