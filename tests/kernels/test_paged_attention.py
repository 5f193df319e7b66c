"""Triton paged attention against a dense fp32 torch reference.

Without CUDA the kernels run under the Triton interpreter on tiny shapes (conftest.py here sets
TRITON_INTERPRET=1 before triton is imported, and says why it must be that early).

GPU tests (realistic shapes, split-K, CUDA graphs, 64-bit offsets):
    pytest tests/kernels/test_paged_attention.py -m gpu
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attention_launches import record_attention_launches

pytest.importorskip("triton")

from rlt_engine.kernels import paged_attention as pa
from rlt_engine.kernels.paged_attention import _launch, decode_splits, paged_attention, supported

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
DEVICE = "cuda" if CUDA else "cpu"

# Declared tolerances (atol = rtol) against the fp32 reference on the same rounded inputs.
FP32_TOL = 1e-5
BF16_TOL = 2e-2
FP16_TOL = 4e-3
GARBAGE_BLOCK = 1_000_000_000  # padding table entries: never dereferenced


class Case:
    """A paged cache with shuffled, non-contiguous blocks and the call arguments for `specs`,
    a list of (q_len, seq_len) per sequence. Every slot not holding a real key is NaN, so any
    read outside the visible keys poisons the output."""

    def __init__(
        self,
        specs: list[tuple[int, int]],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        extra_table: int = 3,
        spare_blocks: int = 5,
        pad_rows: int = 0,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.specs, self.block_size = specs, block_size
        need = [math.ceil(seq_len / block_size) for _, seq_len in specs]
        num_blocks = sum(need) + spare_blocks
        perm = torch.randperm(num_blocks, generator=gen)
        table = torch.full((len(specs), max(need) + extra_table), GARBAGE_BLOCK, dtype=torch.int32)
        k = torch.full((2, num_blocks * block_size, num_kv_heads, head_dim), float("nan"))
        v = k.clone()
        used = 0
        for s, (_, seq_len) in enumerate(specs):
            table[s, : need[s]] = perm[used : used + need[s]].to(torch.int32)
            used += need[s]
            pos = torch.arange(seq_len)
            slots = table[s, pos // block_size].long() * block_size + pos % block_size
            k[1, slots] = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
            v[1, slots] = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        starts = [0]
        for q_len, _ in specs:
            starts.append(starts[-1] + q_len)
        self.num_tokens = starts[-1] + pad_rows
        q = torch.randn(self.num_tokens, num_heads, head_dim, generator=gen)
        dev = torch.device(device)
        # k_all[layer] is how the caller passes one layer of the [layers, slots, kvh, d] cache.
        self.k_all, self.v_all = k.to(dev, dtype), v.to(dev, dtype)
        self.q = q.to(dev, dtype)
        self.block_tables = table.to(dev)
        self.seq_lens = torch.tensor([n for _, n in specs], dtype=torch.int32, device=dev)
        self.query_start = torch.tensor(starts, dtype=torch.int32, device=dev)
        self.max_query_len = max(1, max(q_len for q_len, _ in specs))
        self.scale = head_dim**-0.5

    @property
    def k(self) -> torch.Tensor:
        return self.k_all[1]

    @property
    def v(self) -> torch.Tensor:
        return self.v_all[1]

    def run(self, num_splits: int = 1, out: torch.Tensor | None = None, **tiles) -> torch.Tensor:
        args = (self.q, self.k, self.v, self.block_tables, self.seq_lens, self.query_start)
        rest = (self.block_size, self.scale, self.max_query_len, num_splits, out)
        if tiles:
            return _launch(*args, *rest, **tiles)
        return paged_attention(*args, *rest)

    def reference(self) -> torch.Tensor:
        """Dense fp32: gather each sequence's keys through its table, causal mask, softmax.
        Rows owned by no sequence are 0."""
        q, k, v = self.q.float().cpu(), self.k.float().cpu(), self.v.float().cpu()
        table, bs = self.block_tables.cpu(), self.block_size
        group = q.shape[1] // k.shape[1]
        out = torch.zeros_like(q)
        start = 0
        for s, (q_len, seq_len) in enumerate(self.specs):
            if q_len:
                pos = torch.arange(seq_len)
                slots = table[s, pos // bs].long() * bs + pos % bs
                keys = k[slots].repeat_interleave(group, dim=1)
                vals = v[slots].repeat_interleave(group, dim=1)
                scores = torch.einsum("nhd,chd->hnc", q[start : start + q_len], keys) * self.scale
                q_pos = seq_len - q_len + torch.arange(q_len)
                scores = scores.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
                out[start : start + q_len] = torch.einsum("hnc,chd->nhd", scores.softmax(-1), vals)
            start += q_len
        return out


def check(out: torch.Tensor, ref: torch.Tensor, tol: float, rows: int | None = None) -> None:
    """|out - ref| <= tol + tol * |ref| elementwise (the declared tolerance, atol = rtol)."""
    rows = ref.shape[0] if rows is None else rows
    torch.testing.assert_close(out[:rows].float().cpu(), ref[:rows], atol=tol, rtol=tol)


# Decode rows, fresh prefill chunks, chunks over a paged past, a padding sequence (0 queries).
MIXED = [(1, 1), (1, 37), (5, 5), (7, 40), (0, 3), (1, 70), (3, 19)]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_batch_matches_reference(block_size, heads, num_splits):
    case = Case(MIXED, *heads, head_dim=16, block_size=block_size, pad_rows=2)
    sentinel = torch.full_like(case.q, 7.0)
    out = case.run(num_splits, out=sentinel.clone())
    owned = int(case.query_start[-1])
    check(out, case.reference(), FP32_TOL, owned)
    assert torch.equal(out[owned:], sentinel[owned:])  # rows owned by no sequence: untouched


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("block_size", [3, 5])
def test_small_tiles_non_power_of_two_blocks_and_group(block_size, num_splits):
    """Many key tiles and query tiles per program, splits of several tiles and empty ones,
    non-power-of-two block size and GQA group (6 heads / 2 kv heads), head_dim not a tile size."""
    specs = [(9, 60), (1, 90), (4, 4), (0, 10), (2, 33)]
    case = Case(specs, 6, 2, head_dim=24, block_size=block_size, seed=1)
    out = case.run(num_splits, block_n=16, block_q=2)
    check(out, case.reference(), FP32_TOL)


@pytest.mark.parametrize("seed", range(4))
def test_prefill_query_blocks_numbered_across_sequences(seed):
    """Prefill programs are numbered by query block across the sequences (FLAT): chunks of
    random lengths (empty ones, ones shorter than a block, ones starting mid-block, padding
    rows after them), each query computed by exactly one program. A block a sequence does not
    own, or two programs for one query, would show against the reference."""
    gen = torch.Generator().manual_seed(seed)
    specs = []
    for _ in range(int(torch.randint(1, 10, (1,), generator=gen))):
        q_len = int(torch.randint(0, 11, (1,), generator=gen))
        specs.append((q_len, q_len + int(torch.randint(0, 30, (1,), generator=gen))))
    specs.append((2, 9))  # at least one chunk: max_query_len > 1, the FLAT grid
    case = Case(specs, 4, 2, head_dim=16, block_size=4, pad_rows=5, seed=seed)
    sentinel = torch.full_like(case.q, 7.0)
    out = case.run(out=sentinel.clone(), block_n=16, block_q=4)
    owned = int(case.query_start[-1])
    check(out, case.reference(), FP32_TOL, owned)
    assert torch.equal(out[owned:], sentinel[owned:])


@pytest.mark.parametrize("heads", [(8, 1), (2, 2)], ids=["gqa8", "mha"])
def test_decode_split_k(heads):
    specs = [(1, n) for n in (1, 15, 16, 17, 64, 100, 129, 3)]
    case = Case(specs, *heads, head_dim=32, block_size=16, seed=2)
    ref = case.reference()
    one, four = case.run(1), case.run(4)
    check(one, ref, FP32_TOL)
    check(four, ref, FP32_TOL)
    check(one, four.float().cpu(), FP32_TOL)


@pytest.mark.parametrize("num_splits", [2, 3, 6])
@pytest.mark.parametrize("heads", [(8, 1), (4, 2), (2, 2)], ids=["gqa8", "gqa2", "mha"])
def test_decode_split_k_merged_in_the_kernel(heads, num_splits):
    """With `split_counters` the split that arrives last merges (no merge launch): the same
    attention as the merge kernel's, empty splits and padding sequences included, and the
    counters are back to zero after each launch (the next launch reuses them)."""
    specs = [(1, n) for n in (1, 15, 16, 17, 64, 100, 3)] + [(0, 9)]
    case = Case(specs, *heads, head_dim=32, block_size=16, seed=4, pad_rows=1)
    counters = torch.zeros(len(specs) * heads[1] + 3, dtype=torch.int32)
    sentinel = torch.full_like(case.q, 7.0)
    ref = case.reference()
    for block_n in (16, 32):
        merged = case.run(num_splits, sentinel.clone(), block_n=block_n, split_counters=counters)
        assert not counters.any()
        two_launches = case.run(num_splits, block_n=block_n)
        check(merged, ref, FP32_TOL, rows=7)
        check(merged, two_launches.float().cpu(), FP32_TOL, rows=7)
        assert torch.equal(merged[7:], sentinel[7:])  # rows of no sequence: untouched


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa2", "mha"])
def test_empty_splits_change_no_bit(heads):
    """A merged decode split more ways than its contexts have key tiles: the splits with no
    keys leave at once (before the wait where settled) and the last split with keys merges.
    The same bits as 4 ways (one tile a split either way), the counters back to zero."""
    specs = [(1, n) for n in (1, 16, 17, 40, 64)]  # 1 to 4 tiles of 16 keys
    case = Case(specs, *heads, head_dim=32, block_size=16, seed=9)
    counters = torch.zeros(len(specs) * heads[1], dtype=torch.int32)
    tiles = dict(block_n=16, kernel="mma", split_counters=counters)
    want = case.run(4, **tiles)
    check(want, case.reference(), FP32_TOL)
    for splits, settled in ((5, False), (16, False), (16, True)):
        assert torch.equal(case.run(splits, prefetch_kv=settled, **tiles), want), splits
        assert not counters.any()
    # a context of one tile: its one split writes the output itself, the bits of a merge of
    # one partial (weight exp2(0) = 1, sums 0 + x) and of the unsplit walk
    one_tile = Case(specs[:2], *heads, head_dim=32, block_size=16, seed=9)
    unsplit = one_tile.run(1, block_n=16, kernel="mma")
    assert torch.equal(one_tile.run(16, **tiles), unsplit)
    assert not counters.any()


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("settled", [False, True])
@pytest.mark.parametrize("seqs", [1, 2])
def test_one_or_two_short_sequences_split_in_tiles_of_128_keys(seqs, settled, kv_heads):
    """One or two decode sequences below LONG_CONTEXT keys (MHA or GQA): WIDE_TILE_SPLITS
    ways of WIDE_TILE's 128-key tiles. Up to 128 keys a sequence's one split walks one tile
    and writes the output itself: the unsplit walk's bits (one 128-key tile too), no ticket
    drawn; more keys merge."""
    assert seqs <= pa.WIDE_TILE_SEQS
    counters = torch.zeros(8, dtype=torch.int32)
    for keys in (1, 100, 128, 129, 199):
        specs = [(1, keys), (1, 128 if keys > 128 else 1 + keys // 3)][:seqs]
        case = Case(specs, 4, kv_heads, head_dim=32, block_size=16, seed=keys)
        splits = decode_splits(seqs, long_context=False, mha=kv_heads == 4)
        assert splits == pa.WIDE_TILE_SPLITS
        split = case.run(splits, kernel="mma", split_counters=counters, prefetch_kv=settled)
        assert not counters.any()
        check(split, case.reference(), FP32_TOL)
        if keys <= 128:
            assert torch.equal(split, case.run(1, kernel="mma", prefetch_kv=settled)), keys


def test_split_counters_are_checked():
    case = Case([(1, 20), (1, 5)], 2, 2, head_dim=16, block_size=16)
    for bad in (torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int64)):
        with pytest.raises(ValueError, match="split_counters must be int32"):
            case.run(2, block_n=16, split_counters=bad)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("block_size", "block_n"), [(16, None), (5, 16), (1, 32)])
def test_decode_rows_kernel_matches_reference_and_mma(block_size, block_n, num_splits):
    """MHA decode rows take the register kernel ("rows"); it agrees with the reference and
    with the general tensor-core kernel, padding sequences (no query) stay untouched, and
    head_dim need not be a power of two."""
    specs = [(1, n) for n in (1, 15, 16, 17, 50, 3)] + [(0, 7)]
    case = Case(specs, 3, 3, head_dim=24, block_size=block_size, pad_rows=2, seed=5)
    sentinel = torch.full_like(case.q, 7.0)
    tiles = {} if block_n is None else {"block_n": block_n}
    rows = case.run(num_splits, out=sentinel.clone(), kernel="rows", **tiles)
    mma = case.run(num_splits, kernel="mma")
    owned = int(case.query_start[-1])
    check(rows, case.reference(), FP32_TOL, owned)
    check(rows, mma.float().cpu(), FP32_TOL, owned)
    assert torch.equal(rows[owned:], sentinel[owned:])


def _rope_write_case(
    kernel: str,
    dtype: torch.dtype,
    device: str,
    block_size: int = 4,
    lens: tuple[int, ...] = (1, 5, 17, 40, 9),
    heads: tuple[int, int] | None = None,
    head_dim: int = 24,
):
    """A decode case for `rope_write`: pre-RoPE q, the rows' new k / v, cos / sin, the slots
    of their last positions; the last row is idle and writes the trash slot (a spare block's),
    as the engine's idle rows do, and a padding sequence has no query."""
    heads = heads or ((3, 3) if kernel == "rows" else (4, 2))
    specs = [(1, n) for n in lens] + [(0, 6)]
    case = Case(specs, *heads, head_dim, block_size=block_size, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(11)
    rows, kvh, d = case.num_tokens, heads[1], head_dim
    table, bs = case.block_tables.cpu(), block_size
    last = [table[s, (n - 1) // bs].item() * bs + (n - 1) % bs for s, (_, n) in enumerate(specs)]
    used = {int(b) for b in table.flatten() if b != GARBAGE_BLOCK}
    spare = next(b for b in range(case.k.shape[0] // bs) if b not in used)
    trash = spare * bs  # a spare block's slot: never read
    slots = torch.tensor([*last[: len(lens) - 1], trash], dtype=torch.int64)
    angle = torch.rand(rows, d // 2, generator=gen) * 6.0
    angle = torch.cat([angle, angle], -1)
    new = (
        angle.cos(), angle.sin(), torch.randn(rows, kvh, d, generator=gen),
        torch.randn(rows, kvh, d, generator=gen), slots,
    )  # fmt: skip
    moved = (t.to(device, dtype if t.is_floating_point() else None) for t in new)
    return case, pa.RopeWrite(*moved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("kernel", ["mma", "rows"])
def test_rope_write_equals_rope_kv_write_then_attention(kernel, num_splits, dtype):
    """Decode with `rope_write` (the rows kernel rotates q and k and writes K/V itself; the
    tensor-core kernel's launch is preceded by rope_kv_write) against kernels/rope_kv_write then
    attention: the same output and pools, bit for bit."""
    from rlt_engine.kernels.rope_kv_write import rope_write_kv_

    case, new = _rope_write_case(kernel, dtype, DEVICE)
    args = (case.block_tables, case.seq_lens, case.query_start, case.block_size, case.scale, 1)
    k_pool, v_pool, q = case.k.clone(), case.v.clone(), case.q.clone()
    rope_write_kv_(q, new.k.clone(), new.v, new.cos, new.sin, k_pool, v_pool, new.slot_mapping)
    want = _launch(q, k_pool, v_pool, *args, num_splits, kernel=kernel)
    k2, v2 = case.k.clone(), case.v.clone()
    q_before, k_before = case.q.clone(), new.k.clone()
    got = _launch(case.q, k2, v2, *args, num_splits, kernel=kernel, rope_write=new)
    owned = int(case.query_start[-1])
    assert torch.equal(got[:owned], want[:owned])
    trash = new.slot_mapping[-1]
    for mine, theirs in ((k2, k_pool), (v2, v_pool)):
        keep = torch.ones(mine.shape[0], dtype=torch.bool, device=mine.device)
        keep[trash] = False
        torch.testing.assert_close(mine[keep], theirs[keep], rtol=0, atol=0, equal_nan=True)
    if kernel == "rows":  # the fused kernel leaves its inputs as they were
        assert torch.equal(case.q, q_before) and torch.equal(new.k, k_before)


def test_rope_write_refuses_what_it_cannot_run():
    case, new = _rope_write_case("mma", torch.float32, DEVICE)
    args = (case.q, case.k, case.v, case.block_tables, case.seq_lens, case.query_start)
    with pytest.raises(ValueError, match="decode rows"):
        paged_attention(*args, case.block_size, case.scale, 2, rope_write=new)
    with pytest.raises(ValueError, match="int64"):
        bad = new._replace(slot_mapping=new.slot_mapping.int())
        paged_attention(*args, case.block_size, case.scale, 1, rope_write=bad)


def test_auto_takes_the_rows_kernel_for_many_short_or_split_long_decode_rows(monkeypatch):
    """The measured rule: >= 512 (sequence, head) programs, no split, no long context; or a
    long context split; and "auto" dispatches by it (the rule is patched here: 512 programs
    are slow to interpret)."""
    assert pa._rows_wins(32, 16, 1, False) and pa._rows_wins(512, 1, 1, False)
    assert not pa._rows_wins(31, 16, 1, False)
    assert not pa._rows_wins(32, 16, 1, True)
    assert pa._rows_wins(2, 16, 32, True) and pa._rows_wins(8, 16, 16, True)
    # split below LONG_CONTEXT: from ROWS_SHORT_SEQS sequences on
    assert pa._rows_wins(8, 16, 16, False) and not pa._rows_wins(7, 16, 16, False)
    assert not pa._rows_wins(1, 16, 16, True)  # one sequence keeps the tensor-core walk
    case = Case([(1, 5 + i) for i in range(4)], 2, 2, head_dim=16, block_size=4, seed=6)
    rows, mma = case.run(kernel="rows"), case.run(kernel="mma")
    assert not torch.equal(rows, mma)  # different arithmetic: tells them apart
    seen = []
    monkeypatch.setattr(pa, "_rows_wins", lambda *a: seen.append(a) or True)
    assert torch.equal(case.run(), rows)
    monkeypatch.setattr(pa, "_rows_wins", lambda *a: seen.append(a) or False)
    args = (case.q, case.k, case.v, case.block_tables, case.seq_lens, case.query_start, 4)
    assert torch.equal(paged_attention(*args, case.scale, 1, long_context=True), mma)
    assert seen == [(4, 2, 1, False), (4, 2, 1, True)]  # 4 sequences, 2 heads
    assert decode_splits(8, True) == 4 and decode_splits(8, False) == decode_splits(64, True) == 1
    assert decode_splits(1, True) == 16  # GQA
    assert decode_splits(1, False) == decode_splits(1, False, mha=True) == pa.WIDE_TILE_SPLITS == 2
    assert decode_splits(2, False) == 2 and decode_splits(3, False) == 1  # 2: the wide tile
    # a long MHA context: the rows kernel, split ROWS_SPLIT_BUDGET // n ways, at most 32
    # (one sequence keeps its 16 ways on the tensor-core walk)
    assert [decode_splits(n, True, mha=True) for n in (1, 2, 4, 8, 16)] == [16, 32, 32, 16, 8]
    assert decode_splits(17, True, mha=True) == 1 and decode_splits(7, False, mha=True) == 1
    assert decode_splits(2, True) == 8 and decode_splits(2, False, mha=True) == 2
    # below LONG_CONTEXT, MHA batches of ROWS_SHORT_SEQS to SPLIT_SEQS sequences: the same
    assert [decode_splits(n, False, mha=True) for n in (8, 12, 16, 17)] == [16, 10, 8, 1]
    assert decode_splits(8, False) == 1  # GQA: the tensor-core walk, unsplit


def test_the_split_rows_kernel_takes_rows_split_keys_a_tile(monkeypatch):
    """ROWS_SPLIT_KEYS (an A/B switch) sets the split rows kernel's tile (bf16 d=128 rows of
    256 bytes; fp32 rows of 512 take half, at least 16); the unsplit kernel keeps 32."""
    assert pa._rows_tiles(256, 16) == (16, 1, 2) and pa._rows_tiles(256, 1) == (32, 1, 2)
    monkeypatch.setattr(pa, "ROWS_SPLIT_KEYS", 32)
    assert pa._rows_tiles(256, 16)[0] == 32 and pa._rows_tiles(512, 16)[0] == 16
    assert pa._rows_tiles(256, 1)[0] == 32


@pytest.mark.parametrize("settled", [False, True])
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("num_splits", [2, 5, 16])
def test_rows_kernel_merged_in_the_kernel_changes_no_bit(num_splits, rope, settled):
    """The rows kernel with `split_counters`: the split that arrives last merges (no merge
    launch), with the same bits as the merge launch, splits with no keys leave at once,
    padding sequences and rows of no sequence stay untouched, the counters are back to zero;
    with `rope_write` too (the split holding the new key writes it); and with the caller's
    `prefetch_kv` word (SETTLED: the metadata and first table entries read first)."""
    if rope:
        case, new = _rope_write_case("rows", torch.float32, "cpu", lens=(1, 5, 17, 40, 9))
        extra = {"rope_write": new}
    else:
        specs = [(1, n) for n in (1, 15, 16, 17, 50, 3, 90)] + [(0, 7)]
        case = Case(specs, 3, 3, head_dim=24, block_size=5, pad_rows=2, seed=5)
        extra = {}
    counters = torch.zeros(case.block_tables.shape[0] * 3, dtype=torch.int32)
    sentinel = torch.full_like(case.q, 7.0)
    tiles = {"kernel": "rows", "block_n": 16}

    def run(**more):
        k, v = case.k.clone(), case.v.clone()  # rope_write writes the new keys into them
        args = (case.q.clone(), k, v, case.block_tables, case.seq_lens, case.query_start)
        rest = (case.block_size, case.scale, case.max_query_len, num_splits, sentinel.clone())
        return _launch(*args, *rest, **tiles, **extra, **more), k, v

    merged, k1, v1 = run(split_counters=counters, prefetch_kv=settled)
    assert not counters.any()
    two_launches, k2, v2 = run()
    assert torch.equal(merged, two_launches)
    for written, want in ((k1, k2), (v1, v2)):  # unused slots hold NaN
        torch.testing.assert_close(written, want, rtol=0, atol=0, equal_nan=True)
    owned = int(case.query_start[-1])
    assert torch.equal(merged[owned:], sentinel[owned:])
    if not rope:
        check(merged, case.reference(), FP32_TOL, owned)


def test_decode_rows_kernel_refuses_what_it_cannot_run():
    gqa = Case([(1, 9)], 4, 2, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="rows kernel"):
        gqa.run(kernel="rows")
    chunk = Case([(3, 9)], 2, 2, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="rows kernel"):
        chunk.run(kernel="rows")
    with pytest.raises(ValueError, match="kernel must be"):
        chunk.run(kernel="flash")


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.bfloat16, BF16_TOL), (torch.float16, FP16_TOL)], ids=["bf16", "fp16"]
)
def test_half_precision(dtype, tol):
    case = Case(MIXED, 4, 2, head_dim=32, block_size=4, dtype=dtype, seed=3)
    for num_splits in (1, 3):
        out = case.run(num_splits)
        assert out.dtype == dtype
        check(out, case.reference(), tol)


def test_strided_q_and_out_views():
    """q and out as views into packed buffers (token stride larger than heads * head_dim)."""
    case = Case(MIXED, 4, 2, head_dim=16, block_size=4, seed=4)
    packed = torch.randn(case.num_tokens, 8, 16)
    packed[:, 2:6] = case.q
    out_buf = torch.zeros(case.num_tokens, 6, 16)
    case.q = packed[:, 2:6]
    out = case.run(3, out=out_buf[:, 1:5])
    assert out.data_ptr() == out_buf[:, 1:5].data_ptr()
    check(out_buf[:, 1:5], case.reference(), FP32_TOL)
    assert torch.equal(out_buf[:, 0], torch.zeros_like(out_buf[:, 0]))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_only_padding_sequences_is_a_noop(num_splits):
    case = Case([(0, 5), (0, 9)], 2, 2, head_dim=16, block_size=4, pad_rows=3)
    out = torch.full_like(case.q, 3.0)
    case.run(num_splits, out=out)
    assert torch.equal(out, torch.full_like(case.q, 3.0))


def test_kv_prefetch_budget():
    """Ouro decode (bf16, d = 128: 256-byte rows): 8 sequences x 16 heads on the tensor-core
    kernel's 64-key tiles ask for 2 tiles a program (8 MB); from 64 sequences on, none."""
    from rlt_engine.kernels.paged_attention import KV_PREFETCH_BYTES, kv_prefetch_tiles

    assert kv_prefetch_tiles(8 * 16, 64, 256) == 2
    assert KV_PREFETCH_BYTES >= 2 * (8 * 16) * 2 * 64 * 256
    assert kv_prefetch_tiles(64 * 16, 32, 256) == 0
    assert kv_prefetch_tiles(8 * 16, 32, 256) == 4  # the rows kernel's 32-key tiles


def test_prefetch_kv_is_a_hint_only():
    """`prefetch_kv` (an L2 hint under PDL, never on here) leaves every result as it was."""
    case = Case([(1, 37), (1, 5), (0, 3)], 4, 2, 16, 8, torch.float32, "cpu")
    plain = case.run()
    assert torch.equal(case.run(kernel="auto", prefetch_kv=True)[:2], plain[:2])
    mha = Case([(1, 37), (1, 5), (0, 3), (1, 16)], 3, 3, 16, 8, torch.float32, "cpu")
    for splits in (1, 3):  # the rows kernel's settled reads (SETTLED), unsplit and split
        rows = mha.run(splits, kernel="rows", block_n=16)
        settled = mha.run(splits, kernel="rows", block_n=16, prefetch_kv=True)
        assert torch.equal(settled[:3], rows[:3])


@pytest.mark.parametrize("block_size", [1, 4, 5])
@pytest.mark.parametrize(("num_splits", "merge"), [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("early_keys_seqs", [1, 6])
def test_settled_decode_changes_no_bit(
    early_keys_seqs, heads, num_splits, merge, block_size, monkeypatch
):
    """`prefetch_kv`'s word (the kernel before wrote only the rows' own q, K and V): the
    metadata read before the wait (SETTLED, a merged split), and the first key tile's older
    keys (EARLY_KEYS: 6 sequences here, the launch takes 1), the rows' own keys after, into
    the same tile; every bit as without it. One-tile and many-tile contexts, a split with no
    key, a tile of only the row's own key, a padding sequence; unseen slots are NaN."""
    monkeypatch.setattr(pa, "EARLY_KEYS_SEQS", early_keys_seqs)
    specs = [(1, 1), (1, 16), (1, 17), (1, 40), (0, 3), (1, 70)]
    case = Case(specs, *heads, head_dim=16, block_size=block_size)
    counters = torch.zeros(len(specs) * heads[1], dtype=torch.int32) if merge else None
    tiles = dict(block_n=16, kernel="mma", split_counters=counters)
    plain = case.run(num_splits, **tiles)
    settled = case.run(num_splits, prefetch_kv=True, **tiles)
    rows = sum(q for q, _ in specs)
    assert torch.equal(settled[:rows], plain[:rows])
    check(settled, case.reference(), FP32_TOL, rows)


def test_older_keys_before_the_wait_for_few_or_wide_tile_decode_on_the_callers_word_only(
    monkeypatch,
):
    """The launch reads older keys before the wait (EARLY_KEYS) for a decode of at most
    EARLY_KEYS_SEQS sequences at any context and of at most WIDE_TILE_SEQS below
    LONG_CONTEXT keys (the wide tile), and only where the caller vouches for it
    (`prefetch_kv`); never for prefill or a longer batch."""
    launches = record_attention_launches(monkeypatch)
    one = Case([(1, 20)], 2, 2, head_dim=16, block_size=4)
    two = Case([(1, 20), (1, 9)], 2, 2, head_dim=16, block_size=4)
    prefill = Case([(3, 20)], 2, 2, head_dim=16, block_size=4)
    three = Case([(1, 20), (1, 9), (1, 5)], 2, 2, head_dim=16, block_size=4)
    runs = [(one, True, False), (one, False, False), (one, True, True), (two, True, False)]
    runs += [(two, True, True), (three, True, False), (prefill, True, False)]
    for case, vouched, long_context in runs:
        case.run(kernel="mma", prefetch_kv=vouched, long_context=long_context)
    assert (pa.EARLY_KEYS_SEQS, pa.WIDE_TILE_SEQS) == (1, 2)
    seen = [kwargs["EARLY_KEYS"] for _, kwargs in launches]
    assert seen == [True, False, True, True, False, False, False]


def test_probe_is_for_compiled_builds_of_the_right_shape():
    """`probe` (benchmarks' timer stamps) needs the compiled kernel: refused under the
    interpreter, and a buffer of the launch's programs x len(PROBE_FIELDS)."""
    case = Case([(1, 9), (1, 5)], 2, 2, head_dim=16, block_size=4)
    probe = torch.zeros((4, len(pa.PROBE_FIELDS)), dtype=torch.int64)
    with pytest.raises(ValueError, match="probe"):
        case.run(kernel="mma", probe=probe)
    with pytest.raises(ValueError, match="probe"):
        case.run(kernel="mma", probe=probe[:3])
    with pytest.raises(ValueError, match="probe"):  # the rows kernel's too
        case.run(kernel="rows", probe=probe)
    with pytest.raises(ValueError, match="probe"):
        case.run(kernel="rows", probe=probe.int())


# compiled in a process of its own: this one imported triton for the interpreter
_COMPILE_PROBE = """
from rlt_engine.kernels import paged_attention as pa, pdl

pa._import_triton(); pdl._import_triton(); pa._prefetch_helpers()
pa.clocks, pa.clock_after = pdl.clocks, pdl.clock_after
pa.store_stamps = pa._kernel(pa._store_stamps, False)
pa.attend_tile, pa.kv_tile = pa._kernel(pa._attend_tile, False), pa._kernel(pa._kv_tile, False)
fn = pa._kernel(pa._paged_attention_kernel, False)
out = {}
for splits, merge, settled in ((1, False, False), (1, False, True), (4, True, False),
                               (4, True, True)):
    const = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, GROUP=1, BLOCK_Q=1, BLOCK_M=16,
                 BLOCK_N=64, NUM_SPLITS=splits, PRECISION="tf32", UPCAST=False, PDL=True,
                 PREFETCH_KV=True, ROW_LINES=2, LINE=64, PROBE=True, MERGE=merge,
                 SETTLED=settled or merge, EARLY_KEYS=settled, FLAT=False,
                 SEQ_BLOCK=1)
    sig = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")} | {"qk_scale": "fp32"}
    sig |= {n: "*fp32" for n in ("ws_acc_ptr", "ws_m_ptr", "ws_l_ptr")}
    sig |= {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr",
                                "count_ptr")}
    sig["probe_ptr"] = "*i64"
    name = ("merge" if merge else "plain") + ("-settled" if settled else "")
    out[name] = triton_ptx(fn, const, sig, num_warps=4, num_stages=1 if merge else 2)
print(json.dumps(out))
"""


def test_probe_builds_compile_for_sm90_with_every_stamp():
    """A PROBE build (plain walk and split-merge walk, EARLY_KEYS or not) compiles for sm_90
    and reads the timer for each of its ns stamps: start, wait, end, and the three that wait
    for their data (metadata, first key tile, last), each stored to its field (a broken PROBE
    build would otherwise show only on the GPU); an EARLY_KEYS build's K/V loads are placed
    before its PDL wait, another's are not."""
    from sm90_compile import TRITON_PTX, run_compile_script

    for name, code in run_compile_script(TRITON_PTX + _COMPILE_PROBE).items():
        assert code.count("%globaltimer") == 6, name
        assert code.count("%clock64") == 3, name
        assert code.count("st.global.b64") >= len(pa.PROBE_FIELDS), name
        # an EARLY_KEYS build reads its older keys' K/V rows (16-byte loads) before the wait
        early = re.findall(r"ld\.global[^\n]*\.v4", code.split("griddepcontrol.wait")[0])
        assert bool(early) == name.endswith("-settled"), name


# the decode launch plans as _launch configures them, compiled for sm_90a (see _COMPILE_PROBE)
_COMPILE_PLANS = """
from rlt_engine.kernels import paged_attention as pa

pa._import_triton()
pa.attend_tile, pa.kv_tile = pa._kernel(pa._attend_tile, False), pa._kernel(pa._kv_tile, False)
pa.merge_partials = pa._kernel(pa._merge_partials, False)
fn = pa._kernel(pa._paged_attention_kernel, False)
plans = {  # name: (keys a tile, warps, splits, stages): bf16, d = 128, MHA
    "wide tile, one short sequence": (*pa.WIDE_TILE, pa.WIDE_TILE_SPLITS, 1),
    "short split": (64, 4, pa.SHORT_SPLITS, 1),
    "unsplit": (128, 4, 1, 2),
}
out = {}
for name, (block_n, warps, splits, stages) in plans.items():
    const = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, GROUP=1, BLOCK_Q=1, BLOCK_M=16,
                 BLOCK_N=block_n, NUM_SPLITS=splits, PRECISION="tf32", UPCAST=False, PDL=True,
                 PREFETCH_KV=False, ROW_LINES=2, LINE=64, PROBE=False, MERGE=splits > 1,
                 SETTLED=True, EARLY_KEYS=True, FLAT=False, SEQ_BLOCK=1)
    sig = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")} | {"qk_scale": "fp32"}
    sig |= {n: "*fp32" for n in ("ws_acc_ptr", "ws_m_ptr", "ws_l_ptr")}
    sig |= {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr",
                                "count_ptr")}
    sig["probe_ptr"] = "*i64"
    out[name] = ptxas_usage(triton_ptx(fn, const, sig, num_warps=warps, num_stages=stages))
print(json.dumps(out))
"""


def test_decode_launch_plans_do_not_spill_on_sm90():
    """One decode sequence's launch plans (their tiles, warps and splits as the module's
    constants set them; the older keys read before the wait) compile for sm_90a without
    spilling registers: ptxas put the wide tile's merged walk (two 128-key tiles in flight)
    at 233 registers with 8 warps, and spilled 568 bytes with 4."""
    from sm90_compile import TRITON_PTX, run_compile_script

    for name, (registers, spilled) in run_compile_script(TRITON_PTX + _COMPILE_PLANS).items():
        assert spilled == 0 and registers <= 255, (name, registers, spilled)


# the rows kernel's decode build (bf16, d = 128, 16 splits merged in the kernel), without and
# with SETTLED's reads before the wait, and their PROBE builds, compiled for sm_90a (see
# _COMPILE_PROBE)
_COMPILE_ROWS = """
from rlt_engine.kernels import paged_attention as pa, pdl

pa._import_triton(); pdl._import_triton()
pa.merge_partials = pa._kernel(pa._merge_partials, False)
pa.clocks, pa.clock_after = pdl.clocks, pdl.clock_after
pa.store_stamps = pa._kernel(pa._store_stamps, False)
fn = pa._kernel(pa._decode_rows_kernel, False)
out = {}
for settled in (False, True):
    for probe in (False, True):
        const = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=16, NUM_SPLITS=16,
                     SPLITS_PAD=16, MERGE=True, SETTLED=settled, PDL=True, PREFETCH_KV=False,
                     ROW_LINES=2, LINE=64, ROPE=False, HALF=64, EXACT_MUL=True,
                     ROUND_BF16=False, PROBE=probe)
        sig = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")} | {"qk_scale": "fp32"}
        sig |= {n: "*fp32" for n in ("ws_acc_ptr", "ws_m_ptr", "ws_l_ptr")}
        sig |= {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr",
                                    "count_ptr")}
        sig |= {"slot_ptr": "*i64", "probe_ptr": "*i64"}
        ptx = triton_ptx(fn, const, sig, num_warps=1, num_stages=2)
        before = ptx.split("griddepcontrol.wait")[0]
        name = ("settled" if settled else "plain") + ("-probe" if probe else "")
        out[name] = [before.count("ld.global"), *ptxas_usage(ptx), ptx.count("%globaltimer"),
                     ptx.count("%clock64"), ptx.count("st.global.b64")]
print(json.dumps(out))
"""


def test_rows_kernel_reads_its_settled_metadata_before_the_pdl_wait():
    """The SETTLED build loads the sequence's query range, length and first table entries
    before `griddepcontrol.wait` (the plain build nothing), and neither spills on sm_90a; their
    PROBE builds (benchmarks' stamps) stamp every field and read nothing more before it."""
    from sm90_compile import TRITON_PTX, run_compile_script

    got = run_compile_script(TRITON_PTX + _COMPILE_ROWS)
    assert got["plain"][0] == 0 and got["settled"][0] >= 4, got
    for name, (_, registers, spilled, *_) in got.items():
        assert spilled == 0 and registers <= 255, (name, registers, spilled)
    for name in ("plain", "settled"):
        # a PROBE build reads the timer for each ns stamp (start, wait, end, and the three that
        # wait for their data), the cycle counter thrice, and stores each field; it reads
        # before the wait what the build without it reads
        loads_before, *_, timers, cycles, stores = got[f"{name}-probe"]
        assert (timers, cycles) == (6, 3) and stores >= len(pa.PROBE_FIELDS), (name, got)
        assert loads_before == got[name][0], (name, got)
        assert got[name][3:5] == [0, 0], (name, got)  # none without it


# a padded prefill wave's launch as _launch configures it (bf16, d = 128, MHA: 64-row blocks,
# FLAT), compiled for sm_90a (see _COMPILE_PROBE)
_COMPILE_PREFILL = """
from rlt_engine.kernels import paged_attention as pa

pa._import_triton()
pa.attend_tile, pa.kv_tile = pa._kernel(pa._attend_tile, False), pa._kernel(pa._kv_tile, False)
pa.merge_partials = pa._kernel(pa._merge_partials, False)
fn = pa._kernel(pa._paged_attention_kernel, False)
const = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, GROUP=1, BLOCK_Q=64, BLOCK_M=64,
             BLOCK_N=64, NUM_SPLITS=1, PRECISION="tf32", UPCAST=False, PDL=True,
             PREFETCH_KV=False, ROW_LINES=2, LINE=64, PROBE=False, MERGE=False, SETTLED=False,
             EARLY_KEYS=False, FLAT=True, SEQ_BLOCK=128)
sig = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")} | {"qk_scale": "fp32"}
sig |= {n: "*fp32" for n in ("ws_acc_ptr", "ws_m_ptr", "ws_l_ptr")}
sig |= {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr", "count_ptr")}
sig["probe_ptr"] = "*i64"
ptx = triton_ptx(fn, const, sig, num_warps=4, num_stages=2)
early = "ld.global" in ptx.split("griddepcontrol.wait")[0]
print(json.dumps({"prefill": ptxas_usage(ptx) + [early]}))
"""


def test_prefill_launch_compiles_for_sm90_without_spills():
    """The FLAT prefill build (each program finds its sequence among 128 query starts, and
    a program with no queries leaves before its PDL wait) compiles for sm_90a without spilling
    registers."""
    from sm90_compile import TRITON_PTX, run_compile_script

    ((registers, spilled, early),) = run_compile_script(TRITON_PTX + _COMPILE_PREFILL).values()
    assert spilled == 0 and registers <= 255, (registers, spilled)
    assert early  # query_start is read before the wait


def test_no_tokens():
    case = Case([(0, 5)], 2, 2, head_dim=16, block_size=4)
    assert case.run().shape == (0, 2, 16)


def test_rejects_bad_arguments():
    case = Case([(1, 5)], 4, 2, head_dim=16, block_size=4)
    args = dict(
        q=case.q,
        k_cache=case.k,
        v_cache=case.v,
        block_tables=case.block_tables,
        seq_lens=case.seq_lens,
        query_start=case.query_start,
        block_size=4,
        scale=0.25,
        max_query_len=1,
    )
    bad = [  # (change, the message naming what is wrong)
        ({"block_tables": case.block_tables.long()}, "block_tables must be int32"),
        ({"seq_lens": case.seq_lens.long()}, "seq_lens must be int32"),
        ({"query_start": case.query_start[:1]}, "query_start must be int32"),
        ({"q": case.q[:, :3]}, "must be a multiple of num_kv_heads"),  # 3 heads over 2 kv
        ({"q": case.q.double()}, "must share one of"),
        ({"v_cache": case.v.half()}, "must share one of"),
        ({"block_size": 0}, "block_size must be a positive int"),
        ({"max_query_len": 0}, "max_query_len must be a positive int"),
        ({"num_splits": 0}, "num_splits must be >= 1"),
        ({"out": torch.empty(1, 4, 8)}, "out must be"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            paged_attention(**{**args, **change})


@pytest.mark.skipif(CUDA, reason="CPU behaviour")
def test_supported_on_cpu():
    assert supported(torch.device("cpu")) == (True, "")
    assert not supported(torch.device("meta"))[0]


def test_unsupported_cpu_fails_clearly():
    """A fresh process: triton imported without TRITON_INTERPRET, then the variable set too late."""
    script = """
import os, torch
os.environ.pop("TRITON_INTERPRET", None)
import triton
from rlt_engine.kernels.paged_attention import paged_attention, supported
ok, why = supported(torch.device("cpu"))
assert not ok and "set TRITON_INTERPRET=1" in why, why
os.environ["TRITON_INTERPRET"] = "1"
ok, why = supported(torch.device("cpu"))
assert not ok and "after triton had been imported" in why, why
i = torch.zeros(1, dtype=torch.int32)
try:
    paged_attention(torch.zeros(1, 1, 16), torch.zeros(4, 1, 16), torch.zeros(4, 1, 16),
                    i[None], i + 1, torch.tensor([0, 1], dtype=torch.int32), 4, 1.0, 1)
except RuntimeError as exc:
    assert "TRITON_INTERPRET" in str(exc), exc
else:
    raise AssertionError("no error")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------------------------
# GPU (run with -m gpu on a CUDA machine)


def _decode_specs(num_seqs: int, max_ctx: int, seed: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_ctx + 1, (num_seqs,), generator=gen).tolist()
    lens[0] = max_ctx
    return [(1, n) for n in lens]


@gpu
@needs_cuda
def test_gpu_supported():
    assert supported(torch.device("cuda")) == (True, "")


@gpu
@needs_cuda
@pytest.mark.parametrize("num_seqs", [8, 64])
def test_gpu_ouro_decode_split_1_vs_4(num_seqs):
    """Ouro-1.4B attention shape: 16 heads, 16 kv heads, head_dim 128, block 16, bf16."""
    case = Case(_decode_specs(num_seqs, 2048, num_seqs), 16, 16, 128, 16, torch.bfloat16, "cuda")
    ref = case.reference()
    one, four = case.run(1), case.run(4)
    check(one, ref, BF16_TOL)
    check(four, ref, BF16_TOL)
    check(one, four.float().cpu(), BF16_TOL)


@gpu
@needs_cuda
@pytest.mark.parametrize("num_seqs", [8, 16, 64])
def test_gpu_rows_settled_changes_no_bit(num_seqs):
    """The rows kernel with the caller's word (`prefetch_kv`: SETTLED's metadata and first
    table entries before the wait, splits without keys leaving there) against it without,
    merged in the kernel with 128 // n splits of 16 keys over short contexts (most splits
    empty), a padding sequence included: the same bits eagerly and on graph replays, the
    counters back to zero."""
    specs = [*_decode_specs(num_seqs, 90, num_seqs), (0, 5)]
    case = Case(specs, 16, 16, 128, 16, torch.bfloat16, "cuda")
    splits = max(1, 128 // num_seqs)
    counters = torch.zeros(len(specs) * 16, dtype=torch.int32, device="cuda")
    tiles = {"block_n": 16, "kernel": "rows", "split_counters": counters}
    rows = sum(q for q, _ in specs)
    plain = case.run(splits, **tiles)
    settled = case.run(splits, prefetch_kv=True, **tiles)
    assert torch.equal(settled[:rows], plain[:rows])
    out = torch.empty_like(case.q)
    case.run(splits, out, prefetch_kv=True, **tiles)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(splits, out, prefetch_kv=True, **tiles)
    for _ in range(20):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:rows], plain[:rows])
    assert not counters.any()


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("num_seqs", "num_splits", "kernel"),
    [(1, 4, "mma"), (8, 4, "mma"), (1, 16, "mma"), (2, 32, "mma"), (8, 16, "rows"),
     (1, 32, "rows")],
)  # fmt: skip
def test_gpu_decode_split_k_merged_in_the_kernel_under_graph_replays(num_seqs, num_splits, kernel):
    """Ouro's shape, bf16, the last split merging (split_counters) inside a CUDA graph replayed
    many times: the merge launch's output to bf16 rounding and the same bits on every replay
    (a missed arrival or a partial read before it was written would show), counters back to
    zero. (Bit for bit against the merge launch only in the interpreter: compiled, the merge
    inlined into the rows kernel rounds a few outputs otherwise.) 32 splits of 32-key tiles
    leave the shorter contexts' last splits empty."""
    case = Case(_decode_specs(num_seqs, 700, num_seqs), 16, 16, 128, 16, torch.bfloat16, "cuda")
    counters = torch.zeros(num_seqs * 16, dtype=torch.int32, device="cuda")
    tiles = {"block_n": 32 if kernel == "mma" else 16, "kernel": kernel}
    want = case.run(num_splits, **tiles)
    check(want, case.reference(), BF16_TOL)
    out = torch.empty_like(case.q)
    case.run(num_splits, out, split_counters=counters, **tiles)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(num_splits, out, split_counters=counters, **tiles)
    graph.replay()
    check(out, want.float().cpu(), BF16_TOL)
    first = out.clone()
    for _ in range(50):
        out.zero_()
        graph.replay()
        assert torch.equal(out, first)
    assert not counters.any()


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "heads", [(16, 16, 128), (32, 8, 64), (8, 1, 128)], ids=["ouro", "gqa4", "mqa"]
)
def test_gpu_prefill_chunks_with_decode_rows(heads):
    specs = [(256, 256), (1, 900), (300, 1500), (0, 7), (17, 2000), (1, 1), (64, 64)]
    case = Case(specs, *heads, block_size=16, dtype=torch.bfloat16, device="cuda", seed=5)
    ref = case.reference()
    for num_splits in (1, 3):
        check(case.run(num_splits), ref, BF16_TOL)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("block_size", "head_dim"),
    [(1, 16), (2, 32), (3, 64), (4, 80), (8, 128), (16, 256), (32, 128), (64, 16), (16, 128)],
)
def test_gpu_fp32_exact(block_size, head_dim):
    """fp32 on the GPU uses IEEE dots (no TF32): triton = torch to 1e-5."""
    case = Case([*MIXED, (1, 300), (40, 200)], 4, 2, head_dim, block_size, device="cuda")
    ref = case.reference()
    for num_splits in (1, 3):
        check(case.run(num_splits), ref, FP32_TOL)


@gpu
@needs_cuda
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_gpu_bf16_head_dims(head_dim):
    case = Case([*MIXED, (1, 700)], 8, 2, head_dim, 16, torch.bfloat16, "cuda", seed=6)
    ref = case.reference()
    for num_splits in (1, 4):
        check(case.run(num_splits), ref, BF16_TOL)


@gpu
@needs_cuda
def test_gpu_cuda_graph_capture_and_replay():
    """Capture once; change q, seq_lens and tables in place; replay = eager on the new data."""
    num_seqs = 16
    case = Case(_decode_specs(num_seqs, 1024, 7), 16, 16, 128, 16, torch.bfloat16, "cuda")
    out = torch.empty_like(case.q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            case.run(4, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(4, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, case.run(4))

    # New data through the same addresses: q, lengths, and tables (row s takes row s-1's
    # blocks, so its new length must fit that row).
    gen = torch.Generator(device="cuda").manual_seed(8)
    case.q.copy_(torch.randn(case.q.shape, device="cuda", generator=gen).to(case.q.dtype))
    perm = torch.arange(num_seqs, device="cuda").roll(1)
    new_lens = (case.seq_lens[perm] - 5).clamp(min=1)
    case.block_tables.copy_(case.block_tables[perm].clone())
    case.seq_lens.copy_(new_lens)
    case.specs = [(1, n) for n in new_lens.tolist()]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, case.run(4))
    check(out, case.reference(), BF16_TOL)


@gpu
@needs_cuda
def test_gpu_64bit_offsets():
    """num_slots * kv_heads * head_dim > 2^31: keys in the last blocks of the pool."""
    block_size, head_dim = 16, 128
    num_slots = (2**31 // head_dim) + 64 * block_size
    k = torch.zeros(num_slots, 1, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    num_blocks = num_slots // block_size
    blocks = torch.tensor([num_blocks - 1, 3, num_blocks - 2], dtype=torch.int32, device="cuda")
    seq_len = 3 * block_size
    gen = torch.Generator(device="cuda").manual_seed(9)
    keys = torch.randn(seq_len, 1, head_dim, device="cuda", generator=gen).bfloat16()
    vals = torch.randn(seq_len, 1, head_dim, device="cuda", generator=gen).bfloat16()
    pos = torch.arange(seq_len, device="cuda")
    slots = blocks[pos // block_size].long() * block_size + pos % block_size
    k[slots], v[slots] = keys, vals
    q = torch.randn(1, 2, head_dim, device="cuda", generator=gen).bfloat16()
    args = (
        q,
        k,
        v,
        blocks[None],
        torch.tensor([seq_len], dtype=torch.int32, device="cuda"),
        torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
        block_size,
        head_dim**-0.5,
        1,
    )
    scores = torch.einsum("hd,cd->hc", q[0].float(), keys[:, 0].float()) * head_dim**-0.5
    ref = (scores.softmax(-1) @ vals[:, 0].float())[None]
    for num_splits in (1, 2):
        out = paged_attention(*args, num_splits=num_splits)
        check(out, ref.cpu(), BF16_TOL)


@gpu
@needs_cuda
@pytest.mark.parametrize(("num_seqs", "max_ctx"), [(64, 128), (256, 128), (64, 1024), (256, 1024)])
def test_gpu_ouro_decode_rows_kernel(num_seqs, max_ctx):
    """The rows kernel at Ouro shapes (bf16) against the reference and the tensor-core
    kernel, and under a CUDA graph (replay = eager)."""
    specs = _decode_specs(num_seqs, max_ctx, num_seqs + max_ctx)
    case = Case(specs, 16, 16, 128, 16, torch.bfloat16, "cuda")
    ref = case.reference()
    rows = case.run(kernel="rows")
    check(rows, ref, BF16_TOL)
    check(rows, case.run(kernel="mma").float().cpu(), BF16_TOL)
    out = torch.empty_like(case.q)
    case.run(out=out, kernel="rows")  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(out=out, kernel="rows")
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, rows)


@gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize(("kernel", "settled"), [("mma", 1), ("mma", 16), ("rows", 1)])
def test_gpu_prefetch_kv_changes_no_bit(kernel, settled, num_splits, monkeypatch):
    """Decode rows with the K/V rows asked of L2 before the PDL wait (`prefetch_kv`), and
    with every sequence's older keys read before it (EARLY_KEYS_SEQS 16): the same bits as
    without, eagerly and replayed from a CUDA graph; a padding sequence included."""
    monkeypatch.setattr(pa, "EARLY_KEYS_SEQS", settled)
    specs = [*_decode_specs(8, 300, 77), (0, 5)]
    case = Case(specs, 16, 16, 128, 16, torch.bfloat16, "cuda")
    plain = case.run(kernel=kernel, num_splits=num_splits)
    out = torch.empty_like(case.q)
    for _ in range(3):
        assert torch.equal(case.run(kernel=kernel, num_splits=num_splits, prefetch_kv=True), plain)
    case.run(out=out, kernel=kernel, num_splits=num_splits, prefetch_kv=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(out=out, kernel=kernel, num_splits=num_splits, prefetch_kv=True)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    rows = sum(q for q, _ in specs)
    assert torch.equal(out[:rows], plain[:rows])


@gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize(("kernel", "num_seqs"), [("mma", 8), ("mma", 1), ("rows", 64)])
def test_gpu_rope_write_changes_no_bit(kernel, num_seqs, num_splits):
    """Ouro's decode shapes (bf16, 16 heads of 128) with `rope_write` and `prefetch_kv`, as
    the decode traversal launches it: output and pools equal rope_kv_write then attention,
    eagerly and replayed from a CUDA graph. The new rows' slots are NaN before every run, so
    an attention launch that read a row's own key before the K/V write (under PDL: before its
    wait) would return NaN."""
    from rlt_engine.kernels.rope_kv_write import rope_write_kv_

    lens = tuple(n for _, n in _decode_specs(num_seqs, 300, 5))
    case, new = _rope_write_case(
        kernel, torch.bfloat16, "cuda", 16, lens, heads=(16, 16), head_dim=128
    )
    args = (case.block_tables, case.seq_lens, case.query_start, case.block_size, case.scale, 1)
    k_pool, v_pool, q = case.k.clone(), case.v.clone(), case.q.clone()
    rope_write_kv_(q, new.k.clone(), new.v, new.cos, new.sin, k_pool, v_pool, new.slot_mapping)
    want = _launch(q, k_pool, v_pool, *args, num_splits, kernel=kernel)
    owned = int(case.query_start[-1])
    k2, v2, out = case.k.clone(), case.v.clone(), torch.empty_like(case.q)
    q_in, k_in = case.q.clone(), new.k.clone()

    def run():  # fresh inputs each time: the tensor-core path rotates q and k in place
        q_in.copy_(case.q)
        k_in.copy_(new.k)
        for pool in (k2, v2):  # the new rows' slots poisoned: read before their write, NaN
            pool.index_fill_(0, new.slot_mapping, float("nan"))
        return _launch(
            q_in, k2, v2, *args, num_splits, out, kernel=kernel, prefetch_kv=True,
            rope_write=new._replace(k=k_in),
        )  # fmt: skip

    for _ in range(2):
        assert torch.equal(run()[:owned], want[:owned])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[:owned], want[:owned])
    keep = torch.ones(k2.shape[0], dtype=torch.bool, device="cuda")
    keep[new.slot_mapping[-1]] = False
    for mine, theirs in ((k2, k_pool), (v2, v_pool)):
        torch.testing.assert_close(mine[keep], theirs[keep], rtol=0, atol=0, equal_nan=True)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("num_seqs", "num_splits", "kernel", "tile_keys"),
    [(8, 16, "rows", 16), (1, 2, "mma", 128), (8, 4, "mma", 64)],
    ids=["rows-8x16", "wide-1x2", "mma-8x4"],
)
def test_gpu_probe_stamps_the_programs_with_keys_in_order(num_seqs, num_splits, kernel, tile_keys):
    """A PROBE launch (benchmarks' stamps; merged in the kernel, with the caller's word, as the
    engine launches decode) writes the bits of the launch without it; a program that leaves
    before its wait without keys keeps its row at -1; every other stamps each field, in order
    (start, wait, metadata, first tile, last tile, end; its SM's cycles likewise). `tile_keys`:
    the keys a tile the launch picks (the rows kernel's 16, one sequence's wide tile, split
    decode's 64)."""
    case = Case(_decode_specs(num_seqs, 90, num_seqs), 16, 16, 128, 16, torch.bfloat16, "cuda")
    counters = torch.zeros(num_seqs * 16, dtype=torch.int32, device="cuda")
    tiles = {"kernel": kernel, "split_counters": counters, "prefetch_kv": True}
    if kernel == "rows":
        tiles["block_n"] = tile_keys
    want = case.run(num_splits, **tiles)
    fields = pa.PROBE_FIELDS
    probe = torch.full((num_seqs * 16 * num_splits, len(fields)), -1, dtype=torch.int64,
                       device="cuda")  # fmt: skip
    assert torch.equal(case.run(num_splits, probe=probe, **tiles), want)
    assert not counters.any()
    p = probe.cpu()
    ran = p[:, 0] >= 0
    assert (p[~ran] == -1).all()

    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    # the splits with keys: as the kernels divide a sequence's tiles among the launch's splits
    used = []
    for _, seq_len in case.specs:
        n_tiles = cdiv(seq_len, tile_keys)
        used.append(cdiv(n_tiles, cdiv(n_tiles, num_splits)))
    assert int(ran.sum()) == 16 * sum(used)
    f = {name: i for i, name in enumerate(fields)}
    order = ["start", "waited", "metadata", "first_tile", "keys_done", "end"]
    stamps = p[ran][:, [f[name] for name in order]]
    assert (stamps[:, 1:] >= stamps[:, :-1]).all(), stamps
    cycles = p[ran][:, [f["start_cycles"], f["waited_cycles"], f["end_cycles"]]]
    assert (cycles[:, 1:] >= cycles[:, :-1]).all()
