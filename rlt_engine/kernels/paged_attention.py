"""Triton paged attention over the depth-aware paged KV cache (docs/kv-cache.md).

The tensor-core kernel serves decode rows and prefill chunks. A program owns one (sequence, tile
of BLOCK_Q queries, kv head, split) and processes every query head of that kv head's GQA group
together: its BLOCK_M rows are (query, head-in-group) pairs, row r = query r // GROUP, head r %
GROUP. It walks the keys the tile can see in tiles of BLOCK_N positions; each key position is
resolved through the sequence's block table (slot = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos
% BLOCK_SIZE), so the key tile is independent of the cache block size and every block size >= 1
works, powers of two or not. Each K/V row read is head_dim contiguous elements (vector loads),
read once per (sequence, query tile, kv head, split). Softmax is online in fp32 (base-2 with the
scale folded into log2(e)); masked keys never touch memory, so padding table entries and unused
slots may hold anything.

The rows kernel serves many short decode rows of MHA (one kv head per head), where a query
row in a tensor-core tile would be 15/16 padding: a program (one warp) owns one (sequence, head,
split) and does the scores and P @ V as fp32 register reductions over [BLOCK_N, d] tiles, with
the same table walk, masking and split-K partials. `auto` picks between them by `_rows_wins`.

Split-K (num_splits > 1): the key tiles of a program's range are cut into num_splits contiguous
parts on the device (from seq_lens), each program writes its unnormalised partial (acc, max, sum)
to a workspace and a second kernel merges them by log-sum-exp; a split with no keys writes
(0, -inf, 0) and merges as empty. Decode rows given `split_counters` need no second kernel:
each split with keys counts its arrival (acq_rel, per (sequence, kv head)) and the last one
merges, a split with none leaves at once; those programs walk their few keys with the loads
pipelined in registers (MERGE).

Prefill programs are numbered by query block across the sequences (FLAT: sequence s owns
blocks [start[s] // BLOCK_Q + s, start[s + 1] // BLOCK_Q + s + 1), found by each program from
query_start), so a launch of T rows and S sequences has T // BLOCK_Q + S programs however its
chunks are cut; decode launches (one query a sequence) keep one program row per sequence.

CUDA-graph capturable: no host synchronisation, the grids depend only on the row count,
num_seqs, num_heads, max_query_len, num_splits and static shapes.

triton is imported lazily (this module imports without it). On CPU the kernels run under the
Triton interpreter, which needs TRITON_INTERPRET=1 *before triton is first imported* in the
process (triton's own helpers such as tl.max are then built for the interpreter); `supported`
reports the case where it was set too late.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import NamedTuple

import torch

from rlt_engine.kernels import pdl as _pdl

triton = tl = None  # set by _import_triton(); the kernels' bodies read the module global `tl`
# the @jit form of _prefetch_kv_l2 and pdl's prefetch_lines, set by _prefetch_helpers (PDL only)
prefetch_kv_l2 = prefetch_lines = None
rotate_full = None  # rope's @jit _rotate_full, set by _rope_helpers (decode with `rope_write`)
attend_tile = kv_tile = None  # the @jit (or interpreted) _attend_tile, _kv_tile: by _launch
merge_partials = None  # the @jit (or interpreted) _merge_partials: by _launch
clocks = clock_after = None  # pdl's @jit _clocks and _clock_after, set by _launch for a `probe`
store_stamps = None  # the @jit _store_stamps, set by _launch for a `probe`

PROBE_FIELDS = (  # what a PROBE build stamps per program, in this order
    "start",  # %globaltimer ns: the program begins (before the PDL wait)
    "waited",  # its PDL wait returned
    "end",  # output (or partial, and the last split's merge) stored
    "start_cycles",  # %clock64 at the same three points: the phases within a program
    "waited_cycles",
    "end_cycles",
    "metadata",  # ns once the sequence's query range and length have landed (EARLY_KEYS,
    # which reads them before the wait: once q and its first key tile's K/V have)
    "first_tile",  # ns once its first key tile's P @ V is done (the metadata's, if no tile)
    "keys_done",  # ns once its last key tile's P @ V is done
)


class RopeWrite(NamedTuple):
    """What a decode launch rotates and writes before it attends (`paged_attention`'s
    `rope_write`): the rows' cos / sin [rows, D] (q's dtype), their new k / v [rows, kv_heads,
    D] (k before RoPE; contiguous last dimension) and the slots they go to [rows] int64."""

    cos: torch.Tensor
    sin: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor


_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def supported(device: torch.device) -> tuple[bool, str]:
    """Whether `paged_attention` can run on `device`, and why not (empty string when it can)."""
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_supported(device.index)
    error = _import_triton()
    if error is not None:
        return False, error
    if device.type == "cpu":
        if _interpreter_mode():
            return True, ""
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            return False, (
                "TRITON_INTERPRET=1 was set after triton had been imported; set it before the "
                "first import of triton to run the Triton interpreter on CPU"
            )
        return False, "Triton runs on CPU only under its interpreter (set TRITON_INTERPRET=1)"
    return False, f"Triton paged attention does not run on device type {device.type!r}"


@functools.cache
def _cuda_supported(index: int | None) -> tuple[bool, str]:
    """`supported` on a GPU: fixed for the process, and asked before every launch (the CUDA
    queries took 2.8 us a call on an H100, ~0.2 s of a 256-slot start-up's launches)."""
    error = _import_triton()
    if error is not None:
        return False, error
    if _interpreter_mode():
        return False, "TRITON_INTERPRET=1 was set when triton was imported: CPU tensors only"
    if not torch.cuda.is_available():
        return False, "CUDA is not available to torch"
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        return False, f"the Triton kernel needs compute capability >= 8.0, got {major}.{minor}"
    return True, ""


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    block_size: int,
    scale: float,
    max_query_len: int,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    long_context: bool = False,
    prefetch_kv: bool = False,
    rope_write: RopeWrite | None = None,
    split_counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of `q` over the paged cache; returns `out` [num_tokens, num_heads, d].

    q [num_tokens, num_heads, d]; k_cache / v_cache [num_slots, num_kv_heads, d] (already
    holding the new tokens' K/V); block_tables int32 [num_seqs, max_blocks]; seq_lens int32
    [num_seqs] (keys visible to the last query of the sequence); query_start int32
    [num_seqs + 1]. Query i of sequence s with q_len queries sits at position
    seq_lens[s] - q_len + i and sees keys [0, position]. Sequences with no queries are no-ops;
    rows of `out` owned by no sequence are left untouched. `max_query_len` (host int) bounds
    q_len; `num_splits` splits each program's keys (split-K, mainly for long decode contexts;
    see `decode_splits`). `long_context`: the caller's hint that some sequence may see
    >= LONG_CONTEXT keys (it picks the kernel for decode rows; results agree either way).
    `prefetch_kv`: the caller's word that the kernel launched just before this one writes
    nothing it reads but the rows' own q, K and V (the qkv GEMM with its RoPE epilogue, or
    RoPE + the K/V write, write no metadata and no older key): a decode launch under PDL
    (kernels/pdl.py) then asks L2 for its programs' K/V rows while that kernel still runs,
    and reads its metadata before its wait where that pays (SETTLED: a split decode, or one
    of at most EARLY_KEYS_SEQS sequences or on the wide tile, which also reads its first key
    tile's older keys there, EARLY_KEYS; the rows' own keys after the wait).
    `rope_write` (decode only, max_query_len 1): q and the new k come before RoPE and the pools
    do not hold the new K/V yet: the values of `rope_kv_write.rope_write_kv_` then this call
    without it. The rows kernel rotates q and k (rope.py's rounding) and writes k and v itself,
    one launch fewer (measured faster at 64 sequences); before the tensor-core kernel
    rope_write_kv_ runs as its own launch (rotating q and k in place), which measured faster at
    8 sequences than the same work inside it (2026-12-02-exit-copies-h200.md).
    `split_counters` (decode split-K): int32 [>= sequences * kv heads], zero, owned by the
    caller and reused by every launch: the split that finishes last merges the others'
    partials itself (no merge launch) and leaves its counter at zero again.
    """
    return _launch(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start,
        block_size,
        scale,
        max_query_len,
        num_splits,
        out,
        long_context=long_context,
        prefetch_kv=prefetch_kv,
        rope_write=rope_write,
        split_counters=split_counters,
    )


# Keys from which a decode batch counts as long (another launch plan). 200 against 1,024:
# Ouro's 8 sequences +4% / +5% / +12.5% at 192 / 320 / 960-token prompts, 32 / 64 sequences
# +26% / +27% at 448 / 960 (the unsplit rows kernel before), 96 keys unchanged
# (2026-12-04-rows-long-h200.md)
LONG_CONTEXT = 200
# K/V bytes a decode launch asks L2 for before its PDL wait (`prefetch_kv`): a few tiles a
# program at small batches; none where they would not stay in the 50 MB L2 until read
KV_PREFETCH_BYTES = 8 << 20


SPLIT_SEQS = 16  # decode batches up to this many sequences may split their keys
SHORT_SPLIT_SEQS = 2  # decode batches up to this many sequences split theirs at any context
# decode batches up to this many sequences (and those on the wide tile, below) read their older
# keys before the PDL wait, where the caller vouches for it (`prefetch_kv`): one sequence +0.4%
# at 96 keys and +3.8% at 448-960 keys end to end; 2 to 8 sequences in their plans then (two:
# 8 ways of 64-key tiles; more: unsplit) were 0.3-1.2% slower, their K/V (3-6 MB from HBM)
# landing after the kernel before had ended (2026-12-04-settled-keys-h200.md)
EARLY_KEYS_SEQS = 1
# Ways a decode batch of n <= SHORT_SPLIT_SEQS sequences splits its keys: SHORT_SPLITS // n,
# whatever its context (a split with no keys leaves at once; below LONG_CONTEXT keys,
# batches of up to WIDE_TILE_SEQS sequences: WIDE_TILE_SPLITS). One sequence, against 4 ways:
# -0.9% at 96 keys, +1.6% / +10.4% / +22.6% at 448 / 960 / 2,000 (8 ways: -0.4%, +2.2%, +7.1%,
# +12.9%; 32: slower from 448 on) (2026-12-04-more-splits-h200.md)
SHORT_SPLITS = 16
LONG_SPLITS = 4  # a long-context batch of <= SPLIT_SEQS sequences (8 ways: c=8 -4.8% at 2k)
# Decode batches of at most WIDE_TILE_SEQS sequences below LONG_CONTEXT keys split
# WIDE_TILE_SPLITS ways with tiles of WIDE_TILE = (keys, warps), their first tile's older keys
# read before the wait where the caller vouches (EARLY_KEYS): a context of up to 128 keys is
# one tile, all but the row's own key read before the wait, whose split writes the output
# itself (no merge); 129-199 keys are two tiles in two splits. One sequence, against 16 ways of
# 64-key tiles: c=1 +2.0% at 64-token prompts (64-96 keys), +0.7% / -0.7% / 0 at 110 / 150 /
# 166; unsplit: +2.1%, but -5.5% at 150 (2026-12-04-wide-tile-h200.md); GQA (Nanbeige): c=1
# +1.8% (2026-12-04-rows-by-loads-h200.md). Two sequences, against 8 ways of 64-key tiles read
# after the wait: c=2 +3.2% at 64-token prompts, +2.3% / +0.8% at 110 / 150 (the wide tile
# with its keys after the wait: +1.7% / +0.6% / -0.9%); three: c=3 -0.1%; 8 sequences -2.9% to
# -3.7% (2026-12-07-wide-tile-two-seqs-h100.md); three / four with their keys after the wait:
# c=3 / 4 -1.4% / -1.9% (2026-12-07-wide-tile-four-seqs-h100.md)
WIDE_TILE_SEQS = 2
WIDE_TILE_SPLITS = 2
WIDE_TILE = (128, 8)  # 4 warps spill the MERGE walk's two tiles in flight
# A long-context MHA batch of ROWS_LONG_SEQS to SPLIT_SEQS sequences runs the rows kernel
# split ROWS_SPLIT_BUDGET // n ways (at most MAX_SPLITS; c=8: 16), merged by its last split:
# one warp a program, thousands of them, keeps more K/V in flight than the tensor-core walk's
# 4-warp programs. c=8 +16%, c=4 +6%, c=2 +3% at 1,100-2,000-token prompts; one sequence
# -6.5% (its tensor-core walk reads older keys before the wait), so it keeps that walk
# (2026-12-04-rows-long-h200.md)
ROWS_LONG_SEQS = 2
ROWS_SPLIT_BUDGET = 128
# Below LONG_CONTEXT keys, MHA batches of ROWS_SHORT_SEQS to SPLIT_SEQS sequences take the same
# split rows kernel: c=12 / 16 +2.0% / +2.4% at 64-token prompts, c=8 +2.7% / +4.8% at 110 /
# 150 and equal at 64; from 2 sequences on, c=4 lost 2.1% (2026-12-04-wide-tile-h200.md)
ROWS_SHORT_SEQS = 8
# Keys a tile of the split rows kernel (bf16, d=128): 16. At 8 x 2,000 keys split 16 ways 37.5
# against 43.9 us with 32 (before a merge launch; 2026-12-04-rows-long-h200.md); at 96 keys 32
# would leave 3 splits with keys to merge where 16 leave 6, not measured. An A/B switch
ROWS_SPLIT_KEYS = 16
MAX_SPLITS = 32


def decode_splits(
    num_seqs: int, long_context: bool, short_seqs: int | None = None, mha: bool = False
) -> int:
    """Split-K for decode rows: few sequences leave most SMs idle with one program per
    (sequence, kv head), each as slow as the keys it must keep in flight. Measured on the H200
    (Ouro shapes): over long contexts 4 splits are 1.3-1.9x faster at 8 sequences from 1k keys
    on and no help at 64 (2026-12-01-paged-attention-h200.json); at 96 keys, merged in the
    kernel, 4 splits are 3% faster end to end at 1 sequence and 6% slower at 8
    (2026-12-02-decode-attention-splits-h200.md), 1.6% faster at 2 and even at 4
    (2026-12-02-l2-ahead-h200.md): short contexts split up to SHORT_SPLIT_SEQS sequences.
    Those split SHORT_SPLITS // n ways: a longer context then keeps more programs busy, a
    shorter one leaves its extra splits empty. `mha` (one kv head per head): a long context
    then takes the rows kernel (`_rows_wins`), split ROWS_SPLIT_BUDGET // n ways, and from
    ROWS_SHORT_SEQS sequences on a short one too. Up to WIDE_TILE_SEQS sequences below
    LONG_CONTEXT keys split WIDE_TILE_SPLITS ways (of WIDE_TILE tiles). `short_seqs`
    (benchmarks): another bound than SHORT_SPLIT_SEQS."""
    if mha and _rows_from(long_context) <= num_seqs <= SPLIT_SEQS:
        return min(MAX_SPLITS, ROWS_SPLIT_BUDGET // num_seqs)
    if num_seqs <= (SHORT_SPLIT_SEQS if short_seqs is None else short_seqs):
        if _wide_tile(num_seqs, long_context):
            return WIDE_TILE_SPLITS
        return max(1, SHORT_SPLITS // num_seqs)
    if long_context and num_seqs <= SPLIT_SEQS:
        return LONG_SPLITS
    return 1


def _rows_from(long_context: bool) -> int:
    """Sequences from which a split MHA decode batch takes the rows kernel."""
    return ROWS_LONG_SEQS if long_context else ROWS_SHORT_SEQS


def _wide_tile(num_seqs: int, long_context: bool) -> bool:
    """Whether a decode batch splits in WIDE_TILE tiles (WIDE_TILE_SPLITS ways)."""
    return num_seqs <= WIDE_TILE_SEQS and not long_context


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    block_size: int,
    scale: float,
    max_query_len: int,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    block_q: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kernel: str = "auto",
    long_context: bool = False,
    prefetch_kv: bool = False,
    rope_write: RopeWrite | None = None,
    probe: torch.Tensor | None = None,
    split_counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` with tuning overrides (tests: small tiles on tiny shapes; benchmark).
    `kernel`: "mma" (the general kernel), "rows" (decode rows of MHA only) or "auto" (rows
    where it was measured faster: `_rows_wins`). `probe` (benchmarks, compiled only): int64
    [programs, len(PROBE_FIELDS)] receiving each program's stamps (PROBE_FIELDS: %globaltimer
    ns and %clock64 at its start, after its PDL wait and at its end; ns once its metadata, its
    first key tile and its last had landed), programs in launch-grid order (the rows kernel's
    (sequence, head, split), the tensor-core kernel's (query block, kv head, split)); programs
    that return early (padding, a split without keys) leave their row as it was."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, query_start, block_size, max_query_len)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    num_seqs = block_tables.shape[0]
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    elif out.stride(-1) != 1:
        raise ValueError("out must be contiguous in its last dimension")
    if num_tokens == 0 or num_seqs == 0:
        return out
    ok, why = supported(q.device)
    if not ok:
        raise RuntimeError(f"Triton paged attention cannot run on {q.device}: {why}")
    interpret = _interpreter_mode()
    pdl = _pdl.enabled(q.device)

    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()

    # Tiles sized by bytes per K/V row: bf16 d=128 -> 64 keys x 64 rows (unsplit decode: 128
    # keys); fp32 or d=256 halve them.
    block_d = max(16, triton.next_power_of_2(head_dim))
    row_bytes = block_d * q.element_size()
    block_n_override = block_n
    if block_n is None:
        block_n = max(16, min(64, 64 * 256 // row_bytes))
        if max_query_len == 1 and num_splits == 1:  # unsplit decode: twice the keys a tile,
            # half the dependent steps (results/2026-12-03-hoisted-loads-h200.md: c=8 +1.25%;
            # also for split decode, c=1 lost 12%: its first split then takes every key)
            block_n = max(16, min(128, 128 * 256 // row_bytes))
    wide = max_query_len == 1 and _wide_tile(num_seqs, long_context)
    if wide and num_splits > 1 and block_n_override is None:
        block_n = max(16, min(WIDE_TILE[0], WIDE_TILE[0] * 256 // row_bytes))
        num_warps = num_warps or WIDE_TILE[1]
    rows = 64 if row_bytes <= 256 else 32  # target BLOCK_M for prefill tiles
    if block_q is None:  # decode: one query; prefill: fill about `rows` rows
        block_q = min(triton.next_power_of_2(max_query_len), max(1, rows // group))
    block_m = max(16, triton.next_power_of_2(block_q * group))
    q_tiles = triton.cdiv(max_query_len, block_q)
    # fp32 inputs: exact fp32 dots (no TF32) so triton matches the torch backend to ~1e-6.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"

    if num_splits == 1:
        ws_acc = ws_m = ws_l = out  # unused
    else:
        f32 = {"dtype": torch.float32, "device": q.device}
        ws_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim), **f32)
        ws_m = torch.empty((num_tokens, num_heads, num_splits), **f32)
        ws_l = torch.empty_like(ws_m)

    if kernel not in ("auto", "mma", "rows"):
        raise ValueError(f"kernel must be auto, mma or rows, got {kernel!r}")
    rows_kernel = kernel == "rows" or (
        kernel == "auto"
        and max_query_len == 1
        and group == 1
        and _rows_wins(num_seqs, num_heads, num_splits, long_context)
    )
    if rows_kernel and (max_query_len != 1 or group != 1):
        raise ValueError("the rows kernel runs decode rows (max_query_len 1) of MHA (group 1)")
    merge_in_kernel = split_counters is not None and num_splits > 1 and max_query_len == 1
    if merge_in_kernel and (
        split_counters.dtype != torch.int32
        or split_counters.numel() < num_seqs * num_kv_heads
        or split_counters.device != q.device
    ):
        raise ValueError(
            f"split_counters must be int32 [>= {num_seqs * num_kv_heads}] on {q.device}"
        )
    rows_block_n, warps, stages = _rows_tiles(row_bytes, num_splits)
    if rows_kernel:
        rows_block_n = block_n_override or rows_block_n
    prefetch_tiles = 0  # key tiles per program asked of L2 before the wait (PREFETCH_KV)
    if prefetch_kv and pdl and max_query_len == 1:
        tile = rows_block_n if rows_kernel else block_n
        prefetch_tiles = kv_prefetch_tiles(num_seqs * num_kv_heads * num_splits, tile, row_bytes)
        if prefetch_tiles:
            _prefetch_helpers()
    rw = rope_write
    if rw is not None:
        _check_rope_write(rw, q, k_cache, max_query_len)
        if not rows_kernel:  # the tensor-core kernel: RoPE and the K/V write launch first
            from rlt_engine.kernels.rope_kv_write import rope_write_kv_

            rope_write_kv_(q, rw.k, rw.v, rw.cos, rw.sin, k_cache, v_cache, rw.slot_mapping)
            rw = None
        else:
            _rope_helpers()
    args = (
        q,
        k_cache,
        v_cache,
        out,
        ws_acc,
        ws_m,
        ws_l,
        block_tables,
        seq_lens,
        query_start,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        block_tables.stride(0),
        block_tables.shape[1],
        num_heads,
        prefetch_tiles,
    )
    shapes = {
        "HEAD_DIM": head_dim,
        "BLOCK_D": block_d,
        "BLOCK_SIZE": block_size,
        "NUM_SPLITS": num_splits,
        "PDL": pdl,
        "PREFETCH_KV": prefetch_tiles > 0,
        # 128-byte lines of a K/V row and elements per line (PREFETCH_KV)
        "ROW_LINES": max(1, row_bytes // _pdl.LINE_BYTES),
        "LINE": _pdl.LINE_BYTES // q.element_size(),
    }
    global merge_partials
    merge_partials = _kernel(_merge_partials, interpret)
    flat = max_query_len > 1  # prefill: query blocks numbered across sequences (FLAT)
    blocks = num_tokens // block_q + num_seqs if flat else num_seqs * q_tiles
    grid = (num_seqs, num_heads, num_splits) if rows_kernel else (blocks, num_kv_heads, num_splits)
    if probe is not None:
        global clocks, clock_after, store_stamps
        shape = (grid[0] * grid[1] * grid[2], len(PROBE_FIELDS))
        if interpret or probe.shape != shape or probe.dtype != torch.int64:
            raise ValueError(f"probe: int64 {list(shape)}, compiled builds only")
        _pdl._import_triton()
        clocks, clock_after = _pdl.clocks, _pdl.clock_after
        store_stamps = _kernel(_store_stamps, False)
    with _on_device(q.device):
        if rows_kernel:
            _kernel(_decode_rows_kernel, interpret)[grid](
                *args,
                *_rope_args(rw, q),
                q if not merge_in_kernel else split_counters,
                q if probe is None else probe,
                **shapes,
                PROBE=probe is not None,
                SPLITS_PAD=triton.next_power_of_2(num_splits),
                MERGE=merge_in_kernel,
                # the caller's word: the metadata and the first tile's table entries read
                # before the PDL wait, the splits without keys leaving there: c=8 +1.0%, c=16
                # +0.4%, c=64 +0.3%, same tokens (H100, 2026-12-06-rows-settled-h100.md)
                SETTLED=prefetch_kv,
                ROPE=rw is not None,
                HALF=head_dim // 2,
                EXACT_MUL=not interpret,  # rope.py: mul.rn, no FMA contraction
                ROUND_BF16=interpret and q.dtype == torch.bfloat16,
                BLOCK_N=rows_block_n,
                num_warps=num_warps or warps,
                num_stages=num_stages or stages,
                **_pdl.launch_options(pdl),
            )
        else:
            # prefill (FLAT): fewer programs than q_tiles per sequence whenever the chunks
            # differ in length, and a grid fixed by the row count (a padded wave: its
            # bucket) alone
            global attend_tile, kv_tile
            attend_tile, kv_tile = _kernel(_attend_tile, interpret), _kernel(_kv_tile, interpret)
            # the first tile's older keys before the wait (EARLY_KEYS): few seqs, the wide tile
            few = max_query_len == 1 and num_seqs <= EARLY_KEYS_SEQS
            early_keys = prefetch_kv and (wide or few)
            _kernel(_paged_attention_kernel, interpret)[grid](
                *args,
                q_tiles,
                num_seqs,
                q if probe is None else probe,
                q if not merge_in_kernel else split_counters,
                **shapes,
                PROBE=probe is not None,
                GROUP=group,
                BLOCK_Q=block_q,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                PRECISION=precision,
                UPCAST=interpret and q.dtype == torch.bfloat16,
                MERGE=merge_in_kernel,
                SETTLED=early_keys or (merge_in_kernel and prefetch_kv),
                EARLY_KEYS=early_keys,
                FLAT=flat,
                SEQ_BLOCK=triton.next_power_of_2(num_seqs + 1) if flat else 1,
                num_warps=num_warps or 4,
                num_stages=num_stages or (1 if merge_in_kernel else 2),
                **_pdl.launch_options(pdl),
            )
    if num_splits > 1 and not merge_in_kernel:
        with _on_device(q.device):
            merge = _kernel(_merge_splits_kernel, interpret)
            merge[(num_seqs * max_query_len, num_heads)](
                out,
                ws_acc,
                ws_m,
                ws_l,
                query_start,
                out.stride(0),
                out.stride(1),
                num_heads,
                max_query_len,
                HEAD_DIM=head_dim,
                BLOCK_D=block_d,
                NUM_SPLITS=num_splits,
                SPLITS_PAD=triton.next_power_of_2(num_splits),
                num_warps=4,
            )
    return out


def kv_prefetch_tiles(programs: int, block_n: int, row_bytes: int) -> int:
    """Key tiles of `block_n` K and V rows of `row_bytes` each a program of a decode launch
    with `programs` programs asks L2 for (`prefetch_kv`): KV_PREFETCH_BYTES over the launch."""
    return KV_PREFETCH_BYTES // (programs * 2 * block_n * row_bytes)


def _prefetch_helpers() -> None:
    global prefetch_kv_l2, prefetch_lines
    if prefetch_kv_l2 is None:
        _pdl._import_triton()
        prefetch_lines = _pdl.prefetch_lines
        prefetch_kv_l2 = _kernel(_prefetch_kv_l2, False)


def _rope_helpers() -> None:
    global rotate_full
    if rotate_full is None:
        from rlt_engine.kernels import rope  # rope imports this module: not at the top

        rope._import_triton()
        rotate_full = rope.rotate_full


def _rope_args(rw: RopeWrite | None, q: torch.Tensor) -> tuple:
    """The rows kernel's RopeWrite arguments (placeholders without one: ROPE is off)."""
    if rw is None:
        return (q, q, 0, 0, q, q, 0, 0, 0, 0, q)
    k, v = rw.k, rw.v
    return (rw.cos, rw.sin, rw.cos.stride(0), rw.sin.stride(0), k, v, k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), rw.slot_mapping)  # fmt: skip


def _check_rope_write(rw: RopeWrite, q: torch.Tensor, k_cache: torch.Tensor, max_query_len: int):
    rows, _, head_dim = q.shape
    kv = (rows, k_cache.shape[1], head_dim)
    if max_query_len != 1 or head_dim % 2:
        raise ValueError("rope_write is for decode rows (max_query_len 1) of an even head_dim")
    if rw.k.shape != kv or rw.v.shape != kv or rw.k.stride(-1) != 1 or rw.v.stride(-1) != 1:
        raise ValueError(f"rope_write k and v must be {kv} with a contiguous last dimension")
    for name, t in (("cos", rw.cos), ("sin", rw.sin)):
        if t.shape != (rows, head_dim) or t.dtype != q.dtype or t.stride(-1) != 1:
            raise ValueError(f"rope_write {name} must be [{rows}, {head_dim}] {q.dtype}")
    if rw.slot_mapping.shape != (rows,) or rw.slot_mapping.dtype != torch.int64:
        raise ValueError(f"rope_write slot_mapping must be [{rows}] int64")


def _rows_wins(num_seqs: int, num_heads: int, num_splits: int, long_context: bool) -> bool:
    """Whether the rows kernel beats the tensor-core one on MHA decode rows. Measured on the
    H200, Ouro shapes, bf16, CUDA graphs (benchmarks/results/2026-12-01-decode-attention-h200.md):
    at 96 keys 13.4 vs 18.7 us (64 sequences) and 54.3 vs 62.1 us (256); a tie or worse with
    fewer than 32 sequences (one program per SM at most, latency-bound either way). From
    LONG_CONTEXT keys the tensor-core kernel's pipelined tiles win unsplit (end to end 32
    sequences x 448-token prompts +26%, 64 x 960 +27%), and the rows kernel split
    (`decode_splits` with `mha`) wins for 2-16 sequences: standalone, 8 x 2,000 keys split 16
    ways 46.2 us merged by its last split (37.5 before a merge launch) against 48.2 for the
    tensor-core kernel; end to end c=8 +16% merged, +9.6% with the merge launch
    (2026-12-04-rows-long-h200.md). Split below LONG_CONTEXT, from ROWS_SHORT_SEQS sequences
    on (2026-12-04-wide-tile-h200.md)."""
    if num_splits > 1:
        return num_seqs >= _rows_from(long_context)
    return num_seqs * num_heads >= 512 and not long_context


def _rows_tiles(row_bytes: int, num_splits: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the rows kernel for K/V rows of `row_bytes`: one
    warp per program was best at every measured shape (more programs resident per SM, more
    loads in flight). Split, ROWS_SPLIT_KEYS keys a tile (bf16 d=128)."""
    keys = ROWS_SPLIT_KEYS if num_splits > 1 else 32
    block_n = max(16, min(keys, keys * 256 // row_bytes))
    return block_n, 1, 2


def _check(q, k_cache, v_cache, block_tables, seq_lens, query_start, block_size, max_query_len):
    """Shape / dtype / device checks only: nothing here reads device memory (no sync)."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "expected q [tokens, heads, d] and k_cache == v_cache [slots, kv_heads, d], got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and cache ({k_cache.shape[2]}) differ")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache and v_cache must share one of {_DTYPES}, got "
            f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous in head_dim")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError("block_tables must be int32 [num_seqs, max_blocks]")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [{num_seqs}]")
    if query_start.shape != (num_seqs + 1,) or query_start.dtype != torch.int32:
        raise ValueError(f"query_start must be int32 [{num_seqs + 1}]")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    for name, t in (("seq_lens", seq_lens), ("query_start", query_start)):
        if t.device != q.device or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous on {q.device}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(max_query_len, int) or max_query_len < 1:
        raise ValueError(f"max_query_len must be a positive int, got {max_query_len!r}")
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head_dim must be in [1, 256], got {head_dim}")


_NOT_IMPORTED = "not imported yet"
_triton_error: str | None = _NOT_IMPORTED


def _import_triton() -> str | None:
    """Import triton once into the module globals; the error message when it is missing."""
    global triton, tl, _triton_error
    if _triton_error == _NOT_IMPORTED:
        try:
            import triton as triton_module
            import triton.language as tl_module
        except ImportError as exc:  # the torch backend must keep working without triton
            _triton_error = f"triton is not installed ({exc})"
        else:
            triton, tl, _triton_error = triton_module, tl_module, None
    return _triton_error


def require_triton() -> tuple:
    """(triton, triton.language) for the kernels' module globals; RuntimeError if missing."""
    error = _import_triton()
    if error is not None:
        raise RuntimeError(error)
    return triton, tl


def _interpreter_mode() -> bool:
    """Whether triton was imported under TRITON_INTERPRET=1: its @jit helpers are interpreted."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.cdiv, InterpretedFunction)


def _on_device(device: torch.device):
    """Launch on the tensors' GPU (triton launches on the current device)."""
    if device.type == "cuda" and device.index not in (None, torch.cuda.current_device()):
        return torch.cuda.device(device)
    return contextlib.nullcontext()


_COMPILED: dict[tuple[str, bool], object] = {}


def _kernel(fn, interpret: bool):
    """The compiled (or interpreted) kernel for `fn`, built once, in the mode triton's own
    helpers were built in (the two cannot be mixed)."""
    key = (fn.__name__, interpret)
    if key not in _COMPILED:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            _fix_interpreter_loop_bounds()
            _COMPILED[key] = InterpretedFunction(fn)
        else:
            from triton.runtime.jit import JITFunction

            _COMPILED[key] = JITFunction(fn)
    return _COMPILED[key]


def _fix_interpreter_loop_bounds() -> None:
    """The triton 3.6 interpreter turns scalars (1-element arrays) into loop bounds with int(),
    which numpy >= 2.4 rejects, so `range(tensor, tensor)` fails (triton-lang/triton#9171, fixed
    upstream by #9172). Re-patch `__index__` after the interpreter's own patch, once; a no-op on
    older numpy or a fixed triton."""
    import numpy as np
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "rlt_fixed", False):
        return
    try:
        int(np.zeros(1))
        return
    except TypeError:
        pass

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.rlt_fixed = True
    interpreter._patch_lang_tensor = patched


# ----------------------------------------------------------------------------------------------
# Kernels (plain functions; see `_kernel`). Annotations are strings (future import), which triton
# reads as constexpr markers, so defining them needs no triton.


def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    ws_acc_ptr,  # [tokens, heads, splits, HEAD_DIM] fp32 (split-K only)
    ws_m_ptr,  # [tokens, heads, splits] fp32: running max, base 2
    ws_l_ptr,  # [tokens, heads, splits] fp32: running sum
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_bt,
    max_blocks,
    num_heads,
    prefetch_tiles,  # PREFETCH_KV: key tiles of its split a program asks L2 for
    q_tiles,  # query tiles per sequence = cdiv(max_query_len, BLOCK_Q) (not FLAT)
    num_seqs,  # FLAT: sequences (rows of the block tables)
    probe_ptr,  # PROBE: int64 [programs, len(PROBE_FIELDS)]
    count_ptr,  # MERGE: int32 [sequences * kv heads], zero between launches: splits arrived
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_Q: tl.constexpr,  # queries per program
    BLOCK_M: tl.constexpr,  # rows per program: next_pow2(BLOCK_Q * GROUP), >= 16 for tl.dot
    BLOCK_N: tl.constexpr,  # key positions per inner iteration
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in fp32 (the triton 3.6 interpreter's tl.dot mishandles bf16)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
    PREFETCH_KV: tl.constexpr,  # decode under PDL: K/V rows asked of L2 before the wait
    ROW_LINES: tl.constexpr,
    LINE: tl.constexpr,
    PROBE: tl.constexpr,  # benchmarks: timer stamps per program (pdl.clocks)
    MERGE: tl.constexpr,  # decode split-K: register-pipelined walk, the last split merges
    SETTLED: tl.constexpr,  # decode whose kernel before writes only the rows' q, K, V:
    # its metadata (and MERGE's first table entries) read before the wait
    EARLY_KEYS: tl.constexpr,  # SETTLED, and its first key tile's older keys too
    FLAT: tl.constexpr,  # prefill: query blocks numbered across sequences (see below)
    SEQ_BLOCK: tl.constexpr,  # FLAT: next_pow2(num_seqs + 1)
):
    if PROBE:
        ns0, cy0 = clocks()
    if FLAT:
        # Sequence s owns query blocks [start[s] // BLOCK_Q + s, start[s + 1] // BLOCK_Q + s
        # + 1): at least cdiv(q_len, BLOCK_Q) of them, the ranges back to back, so
        # rows // BLOCK_Q + sequences programs cover every query whatever the chunks' sizes,
        # and a grid that depends on neither the chunk count nor the longest chunk is one
        # CUDA graph per row bucket. query_start is read before the PDL wait (no caller's
        # kernel before writes it: it comes with the wave's upload), so a block past its
        # sequence's queries leaves without waiting.
        s = tl.arange(0, SEQ_BLOCK)
        starts = tl.load(query_start_ptr + s, mask=s <= num_seqs, other=0)
        first_block = tl.where(s < num_seqs, starts // BLOCK_Q + s, 1 << 30)
        seq = tl.sum((first_block <= tl.program_id(0)).to(tl.int32)) - 1
        q0 = (tl.program_id(0) - tl.sum(tl.where(s == seq, first_block, 0))) * BLOCK_Q
        q_begin = tl.sum(tl.where(s == seq, starts, 0))
        q_len = tl.sum(tl.where(s == seq + 1, starts, 0)) - q_begin
        if q0 >= q_len:
            return
    else:  # one row of programs per sequence, q_tiles each
        seq = tl.program_id(0) // q_tiles
        q0 = (tl.program_id(0) % q_tiles) * BLOCK_Q
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    if PDL and not SETTLED:  # wait for the previous kernel, then release the next
        if PREFETCH_KV:
            prefetch_kv_l2(
                block_tables_ptr, seq_lens_ptr, query_start_ptr, k_ptr, v_ptr,
                stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, max_blocks,
                prefetch_tiles, HEAD_DIM, BLOCK_N, BLOCK_SIZE, NUM_SPLITS, ROW_LINES, LINE,
            )  # fmt: skip
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    # The sequence's metadata, loaded together (none depends on another), and the key range
    # of this program: [0, kv_end) for the query tile, its split's share of the key tiles.
    if not FLAT:
        q_begin = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # position of the sequence's first query
    kv_end = first_pos + tl.minimum(q_len, q0 + BLOCK_Q)
    n_tiles = tl.cdiv(kv_end, BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    t_begin = split * per_split
    t_end = tl.minimum(t_begin + per_split, n_tiles)
    if MERGE and t_begin >= t_end:
        # A split with no keys leaves at once (SETTLED: before the wait, its SM free for the
        # kernel after), and the last of the others merges: a launch may split more ways
        # than a short context has tiles.
        return
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    if SETTLED:
        # Decode, and the kernel before writes nothing this one reads but the rows' own q, K
        # and V (the caller's word): the first key tile's table entries (MERGE: the next
        # tile's too) are read before the wait (under PDL), and with EARLY_KEYS its older keys
        # (the rows' own keys join them after the wait).
        pos = t_begin * BLOCK_N + n
        blk = pos // BLOCK_SIZE
        phys = tl.load(table + blk, mask=(pos < kv_end) & (blk < max_blocks), other=0)
        if MERGE:
            blk = (pos + BLOCK_N) // BLOCK_SIZE
            phys_next = tl.load(table + blk, mask=(t_begin + 1 < t_end) & (blk < max_blocks),
                                other=0)  # fmt: skip
        if EARLY_KEYS:
            slot = phys.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # 64-bit: slot * stride
            old = (pos < first_pos) & (t_begin < t_end)
            k, v = kv_tile(k_base, v_base, slot, old, d, d_ok, stride_ks, stride_vs, 0.0, 0.0)
    if PDL and SETTLED:
        if PREFETCH_KV:
            prefetch_kv_l2(
                block_tables_ptr, seq_lens_ptr, query_start_ptr, k_ptr, v_ptr,
                stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, max_blocks,
                prefetch_tiles, HEAD_DIM, BLOCK_N, BLOCK_SIZE, NUM_SPLITS, ROW_LINES, LINE,
            )  # fmt: skip
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if PROBE:
        ns1, cy1 = clocks()
    if q0 >= q_len:  # past this sequence's queries (or a padding sequence with none)
        return
    if PROBE:  # (the stamps below wait for their data: a reduction each, PROBE builds only)
        if EARLY_KEYS:  # noqa: SIM108  (stamped once q and its first K/V tile landed, below)
            ns_meta = ns1
        else:
            ns_meta = clock_after(first_pos)
        ns_first = ns_meta

    rows = tl.arange(0, BLOCK_M)
    q_idx = q0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = first_pos + q_idx
    token = (q_begin + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if EARLY_KEYS:  # the rows' own keys, written by the kernel before, join the first tile
        own = (pos >= first_pos) & (pos < kv_end) & (t_begin < t_end)
        k, v = kv_tile(k_base, v_base, slot, own, d, d_ok, stride_ks, stride_vs, k, v)
        pos_ok = (pos < kv_end) & (t_begin < t_end)
        if PROBE:  # its metadata was read before the wait: "metadata" is q and K/V landed
            ns_meta = clock_after(
                tl.sum(q.to(tl.float32)) + tl.sum(k.to(tl.float32)) + tl.sum(v.to(tl.float32))
            )
    elif MERGE:
        if not SETTLED:
            pos = t_begin * BLOCK_N + n
            blk = pos // BLOCK_SIZE
            phys = tl.load(table + blk, mask=(pos < kv_end) & (blk < max_blocks), other=0)
            blk = (pos + BLOCK_N) // BLOCK_SIZE
            phys_next = tl.load(table + blk, mask=(t_begin + 1 < t_end) & (blk < max_blocks),
                                other=0)  # fmt: skip
        pos_ok = (pos < kv_end) & (t_begin < t_end)
        slot = phys.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        k, v = kv_tile(k_base, v_base, slot, pos_ok, d, d_ok, stride_ks, stride_vs, 0.0, 0.0)

    if MERGE:
        # Decode split-K (one query a program, few keys each): the walk is pipelined by hand
        # in registers (launched with num_stages 1), the next tile's K/V and the table
        # entries of the one after in flight while a tile is computed. The form the merged
        # split was measured in (2026-12-02-decode-attention-splits-h200.md); alone, for
        # every decode batch, it was no faster than the loop below.
        for t in range(t_begin, t_end):
            pos_n = pos + BLOCK_N
            ok_n = (pos_n < kv_end) & (t + 1 < t_end)
            slot_n = phys_next.to(tl.int64) * BLOCK_SIZE + pos_n % BLOCK_SIZE
            k_n, v_n = kv_tile(k_base, v_base, slot_n, ok_n, d, d_ok, stride_ks, stride_vs,
                               0.0, 0.0)  # fmt: skip
            blk = (pos_n + BLOCK_N) // BLOCK_SIZE
            phys_next = tl.load(table + blk, mask=(t + 2 < t_end) & (blk < max_blocks), other=0)
            m_i, l_i, acc = attend_tile(
                q, k, v, pos, pos_ok, q_pos, m_i, l_i, acc, qk_scale, PRECISION, UPCAST
            )
            k, v, pos, pos_ok = k_n, v_n, pos_n, ok_n
            if PROBE:  # noqa: SIM102  (a constexpr branch: nothing compiled without PROBE)
                if t == t_begin:
                    ns_first = clock_after(tl.sum(acc))
    else:
        t_loop = t_begin
        if EARLY_KEYS:  # the first tile, read early; the loop walks the rest
            m_i, l_i, acc = attend_tile(
                q, k, v, pos, pos_ok, q_pos, m_i, l_i, acc, qk_scale, PRECISION, UPCAST
            )
            t_loop = t_begin + 1
            if PROBE:
                ns_first = clock_after(tl.sum(acc))
        for t in range(t_loop, t_end):
            pos = t * BLOCK_N + n
            pos_ok = pos < kv_end
            blk = pos // BLOCK_SIZE
            phys = tl.load(table + blk, mask=pos_ok & (blk < max_blocks), other=0)
            slot = phys.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            k, v = kv_tile(k_base, v_base, slot, pos_ok, d, d_ok, stride_ks, stride_vs, 0.0, 0.0)
            m_i, l_i, acc = attend_tile(
                q, k, v, pos, pos_ok, q_pos, m_i, l_i, acc, qk_scale, PRECISION, UPCAST
            )
            if PROBE:  # noqa: SIM102  (a constexpr branch: nothing compiled without PROBE)
                if t == t_begin:
                    ns_first = clock_after(tl.sum(acc))
    if PROBE:
        ns_keys = clock_after(tl.sum(acc))

    # Unsplit, or the only split with keys of a launch merged in the kernel: the output itself
    # (the merge's value, its weight exp2(0) = 1: the same bits), no partials, ticket or reload
    if (per_split >= n_tiles) & (NUM_SPLITS == 1 or MERGE):
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(
            ws_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
            acc,
            mask=row_ok[:, None] & d_ok[None, :],
        )
        tl.store(ws_m_ptr + part, m_i, mask=row_ok)
        tl.store(ws_l_ptr + part, l_i, mask=row_ok)
        if MERGE:
            # Every thread's partial is stored (the barrier) before the one release of the
            # arrival; the split that arrives last reads all of them through L2 and merges.
            tl.debug_barrier()
            counter = count_ptr + seq * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            used = tl.cdiv(n_tiles, per_split)  # the splits with keys (n_tiles >= 1 here)
            if arrived == used - 1:
                tl.store(counter, 0)  # every split has arrived: ready for the next launch
                base = (token * num_heads + head) * NUM_SPLITS
                m_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                for i in tl.static_range(NUM_SPLITS):
                    m_s = tl.load(ws_m_ptr + base + i, mask=row_ok & (i < used),
                                  other=float("-inf"), cache_modifier=".cg")  # fmt: skip
                    m_max = tl.maximum(m_max, m_s)
                m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)  # all empty: weights 0
                total = tl.zeros([BLOCK_M], dtype=tl.float32)
                o = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
                for i in tl.static_range(NUM_SPLITS):  # an empty split adds 0 * 0: no bit
                    ok = row_ok & (i < used)
                    m_s = tl.load(ws_m_ptr + base + i, mask=ok, other=float("-inf"),
                                  cache_modifier=".cg")  # fmt: skip
                    w = tl.exp2(m_s - m_ref)
                    l_s = tl.load(ws_l_ptr + base + i, mask=ok, other=0.0,
                                  cache_modifier=".cg")  # fmt: skip
                    a_s = tl.load(
                        ws_acc_ptr + (base + i)[:, None] * HEAD_DIM + d[None, :],
                        mask=ok[:, None] & d_ok[None, :],
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    total += w * l_s
                    o += w[:, None] * a_s
                o = o / tl.where(total == 0.0, 1.0, total)[:, None]
                tl.store(
                    out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                    o.to(out_ptr.dtype.element_ty),
                    mask=row_ok[:, None] & d_ok[None, :],
                )
    if PROBE:
        ns2, cy2 = clocks()
        store_stamps(probe_ptr, ns0, ns1, ns2, cy0, cy1, cy2, ns_meta, ns_first, ns_keys)


def _kv_tile(k_base, v_base, slot, ok, d, d_ok, stride_ks, stride_vs, k_else, v_else):
    """A key tile's K [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_D] at cache slots `slot`
    (64-bit), each row head_dim contiguous elements, read where `ok` (else k_else, v_else:
    0, or the values read before, into which the rows' own keys are merged)."""
    k = tl.load(k_base + slot[None, :] * stride_ks + d[:, None],
                mask=d_ok[:, None] & ok[None, :], other=k_else)  # fmt: skip
    v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :],
                mask=ok[:, None] & d_ok[None, :], other=v_else)  # fmt: skip
    return k, v


def _attend_tile(q, k, v, pos, pos_ok, q_pos, m_i, l_i, acc, qk_scale,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """One key tile of the online softmax: k [BLOCK_D, BLOCK_N] and v [BLOCK_N, BLOCK_D] of
    key positions `pos` (`pos_ok`: inside the range), queries at `q_pos`; the running max,
    sum and accumulator after it. Base-2, the scale folded in; P @ V in the cache dtype."""
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    s = tl.where(pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: no NaN
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(v.dtype)  # P @ V in the cache dtype, as flash attention does
    if UPCAST:
        p, v = p.to(tl.float32), v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc


def _decode_rows_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    ws_acc_ptr,
    ws_m_ptr,
    ws_l_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_bt,
    max_blocks,
    num_heads,
    prefetch_tiles,
    cos_ptr,
    sin_ptr,
    stride_cos,
    stride_sin,
    k_new_ptr,
    v_new_ptr,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    slot_ptr,
    count_ptr,  # MERGE: int32 [sequences * heads], zero between launches: splits arrived
    probe_ptr,  # PROBE: int64 [programs, len(PROBE_FIELDS)]
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next power of two >= NUM_SPLITS
    MERGE: tl.constexpr,  # split-K merged by the split that arrives last (no merge launch)
    SETTLED: tl.constexpr,  # the metadata and the first tile's table entries read before the
    # wait (the caller's word: the kernel before writes only the rows' q, K, V)
    PDL: tl.constexpr,
    PREFETCH_KV: tl.constexpr,
    ROW_LINES: tl.constexpr,
    LINE: tl.constexpr,
    ROPE: tl.constexpr,
    HALF: tl.constexpr,
    EXACT_MUL: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    PROBE: tl.constexpr,  # benchmarks: timer stamps per program (pdl.clocks)
):
    """Decode rows of multi-head attention (one query per sequence, one kv head per head):
    a program owns one (sequence, head, split). With a single query row a tensor-core tile
    would be 15/16 padding, so scores and P @ V are register reductions over [BLOCK_N, d]
    tiles in fp32 (no shared memory: many programs per SM to keep loads in flight)."""
    if PROBE:
        ns0, cy0 = clocks()
        ns1, cy1 = ns0, cy0
    seq = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if PDL and not SETTLED:  # wait for the previous kernel, then release the next (pdl.py)
        if PREFETCH_KV:
            prefetch_kv_l2(
                block_tables_ptr, seq_lens_ptr, query_start_ptr, k_ptr, v_ptr,
                stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, max_blocks,
                prefetch_tiles, HEAD_DIM, BLOCK_N, BLOCK_SIZE, NUM_SPLITS, ROW_LINES, LINE,
            )  # fmt: skip
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        if PROBE:
            ns1, cy1 = clocks()
    # The sequence's metadata, this split's key tiles and its first tile's table entries
    # (SETTLED: before the wait, on the caller's word that the kernel before writes only the
    # rows' q, K and V). A split without keys of a sequence with a query leaves (the last of
    # the splits with keys merges; its split 0 waits, so the launch completes after the kernel
    # before it).
    q_begin = tl.load(query_start_ptr + seq)
    q_end = tl.load(query_start_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)  # the query sits at seq_len - 1, sees every key
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    t_begin = split * per_split
    t_end = tl.minimum(t_begin + per_split, n_tiles)
    if MERGE and (t_begin >= t_end) & (q_end > q_begin):
        return
    pos = t_begin * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = pos // BLOCK_SIZE
    phys_first = tl.load(table + blk, mask=(pos < seq_len) & (blk < max_blocks), other=0)
    if PDL and SETTLED:
        if PREFETCH_KV:
            prefetch_kv_l2(
                block_tables_ptr, seq_lens_ptr, query_start_ptr, k_ptr, v_ptr,
                stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, max_blocks,
                prefetch_tiles, HEAD_DIM, BLOCK_N, BLOCK_SIZE, NUM_SPLITS, ROW_LINES, LINE,
            )  # fmt: skip
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        if PROBE:
            ns1, cy1 = clocks()
    if q_end == q_begin:  # a padding sequence: no query
        return
    if PROBE:  # (the stamps below wait for their data, PROBE builds only)
        ns_meta = clock_after(seq_len)
        ns_first = ns_meta
    token = q_begin.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_row = q_ptr + token * stride_qt + head * stride_qh
    q = tl.load(q_row + d, mask=d_ok, other=0.0)

    k_base = k_ptr + head.to(tl.int64) * stride_kh
    v_base = v_ptr + head.to(tl.int64) * stride_vh
    if ROPE:  # as in _paged_attention_kernel: rotate q, and the new key's split writes it
        swap = tl.where(d < HALF, d + HALF, d - HALF)
        c = tl.load(cos_ptr + token * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + token * stride_sin + d, mask=d_ok, other=0.0).to(tl.float32)
        q_swap = tl.load(q_row + swap, mask=d_ok, other=0.0)
        q = rotate_full(q, q_swap, c, sn, d < HALF, EXACT_MUL, ROUND_BF16)
        if (t_begin < n_tiles) & (n_tiles <= t_end):
            k_new = k_new_ptr + token * stride_knt + head.to(tl.int64) * stride_knh
            v_new = v_new_ptr + token * stride_vnt + head.to(tl.int64) * stride_vnh
            k_row = tl.load(k_new + d, mask=d_ok, other=0.0)
            k_row = rotate_full(
                k_row, tl.load(k_new + swap, mask=d_ok, other=0.0), c, sn, d < HALF,
                EXACT_MUL, ROUND_BF16,
            )  # fmt: skip
            slot_new = tl.load(slot_ptr + token)
            tl.store(k_base + slot_new * stride_ks + d, k_row, mask=d_ok)
            tl.store(v_base + slot_new * stride_vs + d, tl.load(v_new + d, mask=d_ok), mask=d_ok)
            tl.debug_barrier()  # the program's own stores are seen by its loads below
    q = q.to(tl.float32) * qk_scale
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), dtype=tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for t in range(t_begin, t_end):
        pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        pos_ok = pos < seq_len
        blk = pos // BLOCK_SIZE
        later = pos_ok & (blk < max_blocks) & (t != t_begin)  # the first tile's: read above
        phys = tl.where(t == t_begin, phys_first, tl.load(table + blk, mask=later, other=0))
        slot = phys.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_ok = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kv_ok, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
        s = tl.where(pos_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: every tile has a key
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m_i = m_new
        if PROBE:  # noqa: SIM102  (a constexpr branch: nothing compiled without PROBE)
            if t == t_begin:
                ns_first = clock_after(tl.sum(acc))
    if PROBE:
        ns_keys = clock_after(tl.sum(acc))

    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(
            out_ptr + token * stride_ot + head * stride_oh + d,
            o.to(out_ptr.dtype.element_ty),
            mask=d_ok,
        )
    else:
        part = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(ws_acc_ptr + part * HEAD_DIM + d, acc, mask=d_ok)
        tl.store(ws_m_ptr + part, m_i)
        tl.store(ws_l_ptr + part, l_i)
        if MERGE:  # as the tensor-core kernel's MERGE: the stores, one release, the last merges
            tl.debug_barrier()
            counter = count_ptr + seq * num_heads + head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            used = tl.cdiv(n_tiles, per_split)  # the splits with keys (n_tiles >= 1 here)
            if arrived == used - 1:
                tl.store(counter, 0)  # every split has arrived: ready for the next launch
                merge_partials(
                    out_ptr + token * stride_ot + head * stride_oh, ws_acc_ptr, ws_m_ptr,
                    ws_l_ptr, part - split, used, HEAD_DIM, BLOCK_D, SPLITS_PAD, ".cg",
                )  # fmt: skip
    if PROBE:
        ns2, cy2 = clocks()
        store_stamps(probe_ptr, ns0, ns1, ns2, cy0, cy1, cy2, ns_meta, ns_first, ns_keys)


def _prefetch_kv_l2(
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    k_ptr,
    v_ptr,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_bt,
    max_blocks,
    max_tiles,  # at most this many of its key tiles (the launch's byte budget)
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    ROW_LINES: tl.constexpr,  # 128-byte lines per K/V row (a power of two)
    LINE: tl.constexpr,  # elements per line
):
    """Decode programs (sequence, kv head, split), one query per sequence: ask L2 for the K and
    V rows of the first `max_tiles` key tiles this program's split will walk. Reads only the
    block table, seq_lens and query_start, which the kernel before it must not write
    (`paged_attention`'s `prefetch_kv`); issues fire-and-forget prefetches, so it is safe for
    any K/V row. Compiled (PDL) only: the interpreter has no inline assembly."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    has_query = tl.load(query_start_ptr + seq + 1) > tl.load(query_start_ptr + seq)
    seq_len = tl.where(has_query, tl.load(seq_lens_ptr + seq), 0)
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    t_begin = split * per_split
    t_end = tl.minimum(tl.minimum(t_begin + per_split, n_tiles), t_begin + max_tiles)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    lines = tl.arange(0, ROW_LINES) * LINE
    for t in range(t_begin, t_end):
        pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        pos_ok = pos < seq_len
        blk = pos // BLOCK_SIZE
        phys = tl.load(table + blk, mask=pos_ok & (blk < max_blocks), other=0)
        slot = phys.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        ok = pos_ok[:, None] & (lines < HEAD_DIM)[None, :]
        prefetch_lines(tl.where(ok, k_base + slot[:, None] * stride_ks + lines[None, :], k_base))
        prefetch_lines(tl.where(ok, v_base + slot[:, None] * stride_vs + lines[None, :], v_base))


def _merge_splits_kernel(
    out_ptr,
    ws_acc_ptr,
    ws_m_ptr,
    ws_l_ptr,
    query_start_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    max_query_len,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """One program per (sequence, query slot, head): log-sum-exp merge of the split partials."""
    seq = tl.program_id(0) // max_query_len
    i = tl.program_id(0) % max_query_len
    head = tl.program_id(1)
    q_begin = tl.load(query_start_ptr + seq)
    if i >= tl.load(query_start_ptr + seq + 1) - q_begin:
        return
    token = (q_begin + i).to(tl.int64)
    merge_partials(
        out_ptr + token * stride_ot + head * stride_oh, ws_acc_ptr, ws_m_ptr, ws_l_ptr,
        (token * num_heads + head) * NUM_SPLITS, NUM_SPLITS, HEAD_DIM, BLOCK_D, SPLITS_PAD, "",
    )  # fmt: skip


def _store_stamps(probe_ptr, ns0, ns1, ns2, cy0, cy1, cy2, ns_meta, ns_first, ns_keys):
    """A PROBE build's stamps, in PROBE_FIELDS' order, to this program's row of the probe (the
    launch grid's order: program_id 0 slowest, 2 fastest)."""
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2)
    row = probe_ptr + (pid + tl.program_id(2)).to(tl.int64) * 9
    tl.store(row + 0, ns0)
    tl.store(row + 1, ns1)
    tl.store(row + 2, ns2)
    tl.store(row + 3, cy0)
    tl.store(row + 4, cy1)
    tl.store(row + 5, cy2)
    tl.store(row + 6, ns_meta)
    tl.store(row + 7, ns_first)
    tl.store(row + 8, ns_keys)


def _merge_partials(out_row, ws_acc_ptr, ws_m_ptr, ws_l_ptr, part0, used,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr,
                    CACHE: tl.constexpr):  # fmt: skip
    """Log-sum-exp merge of the partials part0 .. part0 + used - 1 (acc, max, sum) into the
    output row `out_row`. A split with no keys (0, -inf, 0) weighs 0, as does one past `used`,
    so the bits do not depend on how many empty splits there were. CACHE ".cg": partials
    stored by other programs of the same launch (read through L2, not L1)."""
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < used
    part = part0 + sp
    m = tl.load(ws_m_ptr + part, mask=sp_ok, other=float("-inf"), cache_modifier=CACHE)
    sums = tl.load(ws_l_ptr + part, mask=sp_ok, other=0.0, cache_modifier=CACHE)
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty split: weight 0
    total = tl.sum(w * sums, axis=0)

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    acc = tl.load(
        ws_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
        mask=sp_ok[:, None] & d_ok[None, :],
        other=0.0,
        cache_modifier=CACHE,
    )
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_row + d, o.to(out_row.dtype.element_ty), mask=d_ok)
