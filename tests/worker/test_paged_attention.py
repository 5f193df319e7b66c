"""The torch paged attention backend against plain dense causal attention (GQA).

Each test lays several sequences into a shared slot pool through shuffled block tables,
pre-writes their earlier K/V directly into the pool, then runs one `attend` call whose rows
mix single-token rows (decode) and multi-token chunk rows (prefill) at different lengths.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from rlt_engine.worker.paged_attention import PagedKVCache, PagedMetadata

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 8


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, H, d], k/v [T, KVH, d]: row t attends to keys 0..t; head h reads kv head h // g."""
    t, h, d = q.shape
    group = h // k.shape[1]
    out = torch.empty(t, h, d, dtype=torch.float64)
    for i in range(t):
        for head in range(h):
            kh, vh = k[: i + 1, head // group].double(), v[: i + 1, head // group].double()
            scores = kh @ q[i, head].double() / math.sqrt(d)
            out[i, head] = scores.softmax(0) @ vh
    return out


def _slots(table: list[int], length: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(length)]


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_matches_dense_for_mixed_single_and_chunk_rows(block_size, seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    # (context length, rows in this call): singles are decode tokens, the rest prefill chunks
    seqs = [(1, 1), (7, 1), (19, 1), (5, 5), (12, 4), (9, 1), (17, 6)]
    num_blocks = sum(-(-length // block_size) for length, _ in seqs) + 5
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    cache = PagedKVCache(
        LAYERS,
        num_blocks * block_size,
        KV_HEADS,
        HEAD_DIM,
        HEADS,
        torch.float32,
        torch.device("cpu"),
    )
    layer = 1
    order = list(range(len(seqs)))
    rng.shuffle(order)  # rows of the call in a scrambled sequence order
    q_rows, k_rows, v_rows, want = [], [], [], []
    positions, slot_mapping = [], []
    single_rows, single_slots, single_lens, chunks = [], [], [], []
    row = 0
    for s in order:
        length, n = seqs[s]
        table = [pool.pop() for _ in range(-(-length // block_size))]
        slots = _slots(table, length, block_size)
        q = torch.randn(length, HEADS, HEAD_DIM, generator=gen)
        k = torch.randn(length, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(length, KV_HEADS, HEAD_DIM, generator=gen)
        prefix = slots[: length - n]
        cache.k[layer, prefix] = k[: length - n]
        cache.v[layer, prefix] = v[: length - n]
        cache.k[0, prefix] = 100.0  # another layer's junk must not leak in
        q_rows.append(q[length - n :])
        k_rows.append(k[length - n :])
        v_rows.append(v[length - n :])
        want.append(dense_causal(q, k, v)[length - n :])
        positions.extend(range(length - n, length))
        slot_mapping.extend(slots[length - n :])
        if n == 1:
            single_rows.append(row)
            single_slots.append(slots)
            single_lens.append(length)
        else:
            chunks.append((row, n, torch.tensor(slots)))
        row += n
    width = max(single_lens)
    padded = [s + [s[0]] * (width - len(s)) for s in single_slots]
    meta = PagedMetadata(
        positions=torch.tensor(positions),
        loop_indices=torch.zeros(row, dtype=torch.long),
        slot_mapping=torch.tensor(slot_mapping),
        single_rows=torch.tensor(single_rows),
        single_slots=torch.tensor(padded),
        single_lens=torch.tensor(single_lens),
        chunks=chunks,
    )
    k_new, v_new = torch.cat(k_rows), torch.cat(v_rows)
    out = cache.attend(layer, torch.cat(q_rows), k_new, v_new, meta)
    assert out.shape == (row, HEADS, HEAD_DIM) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), torch.cat(want), atol=1e-5, rtol=1e-5)
    # the call stored this layer's new K/V in the rows' slots, and only there
    assert torch.equal(cache.k[layer, meta.slot_mapping], k_new)
    assert torch.equal(cache.v[layer, meta.slot_mapping], v_new)


def test_only_chunk_rows_and_only_single_rows():
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(LAYERS, 64, KV_HEADS, HEAD_DIM, HEADS, torch.float32, torch.device("cpu"))
    q = torch.randn(6, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(6, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(6, KV_HEADS, HEAD_DIM, generator=gen)
    slots = torch.tensor([40, 41, 42, 43, 8, 9])  # two blocks of 4, out of order
    chunk_meta = PagedMetadata(
        positions=torch.arange(6),
        loop_indices=torch.zeros(6, dtype=torch.long),
        slot_mapping=slots,
        single_rows=None,
        single_slots=None,
        single_lens=None,
        chunks=[(0, 6, slots)],
    )
    out = cache.attend(0, q, k, v, chunk_meta)
    torch.testing.assert_close(out.double(), dense_causal(q, k, v), atol=1e-5, rtol=1e-5)
    # now the 7th token as a single row over the same slots
    q7 = torch.randn(1, HEADS, HEAD_DIM, generator=gen)
    k7 = torch.randn(1, KV_HEADS, HEAD_DIM, generator=gen)
    v7 = torch.randn(1, KV_HEADS, HEAD_DIM, generator=gen)
    all_slots = torch.cat([slots, torch.tensor([10])])
    single_meta = PagedMetadata(
        positions=torch.tensor([6]),
        loop_indices=torch.zeros(1, dtype=torch.long),
        slot_mapping=torch.tensor([10]),
        single_rows=torch.tensor([0]),
        single_slots=all_slots[None],
        single_lens=torch.tensor([7]),
        chunks=[],
    )
    out7 = cache.attend(0, q7, k7, v7, single_meta)
    want = dense_causal(torch.cat([q, q7]), torch.cat([k, k7]), torch.cat([v, v7]))[-1:]
    torch.testing.assert_close(out7.double(), want, atol=1e-5, rtol=1e-5)


def test_copy_slots_copies_every_layer():
    cache = PagedKVCache(LAYERS, 16, KV_HEADS, HEAD_DIM, HEADS, torch.float32, torch.device("cpu"))
    cache.k.normal_(generator=torch.Generator().manual_seed(0))
    cache.v.normal_(generator=torch.Generator().manual_seed(1))
    before_k, before_v = cache.k.clone(), cache.v.clone()
    cache.copy_slots(torch.tensor([3, 3, 5]), torch.tensor([10, 11, 12]))
    for src, dst in ((3, 10), (3, 11), (5, 12)):
        assert torch.equal(cache.k[:, dst], before_k[:, src])
        assert torch.equal(cache.v[:, dst], before_v[:, src])
    untouched = [i for i in range(16) if i not in (10, 11, 12)]
    assert torch.equal(cache.k[:, untouched], before_k[:, untouched])
    assert torch.equal(cache.v[:, untouched], before_v[:, untouched])
