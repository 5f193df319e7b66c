"""Small-M weight GEMM on Hopper with warp specialisation: `ws_gemm(x, w, config) == x @ w.T`
for decode rows (M <= 64), written in Gluon (Triton's explicit-layout dialect).

Why a second kernel beside kernels/small_gemm: at decode a GEMM is a weight stream that must
wait for its activations, which the kernel before it writes. A Triton program's K-loop
pipeline can only start after its PDL wait, so every GEMM pays the stream's ramp-up (first
loads' latency, tail) again: ~3.3 us a GEMM on the H200 on top of its bytes. Here the work is
split between warps:

- one producer warp streams the program's weight tiles with TMA into a ring of shared-memory
  stages (mbarriers: `full` when a tile has landed, `empty` when it has been consumed). The
  weights depend on no kernel, so it starts at once: under PDL the ring fills while the kernel
  before still runs;
- four consumer warps (one warpgroup) execute the PDL wait, load the program's activation rows
  for its whole K range in one go (rows >= M filled with zeros; TMA, or cp.async up to
  X_BY_LOADS_ROWS rows), then run one wgmma per stage, swap-AB: out.T[BLOCK_N, BM] =
  w[BLOCK_N, k] @ x.T[k, BM], both operands read from shared memory, BM = 8, 16, 32 or 64
  (`rows_tile`) the MMA's narrow side. Everything queued before a copy lands before it (the
  memory system serves requests about in order), so the rows wait for the weight tiles
  issued ahead of them: `RING_AHEAD_BYTES` bounds those where that pays. The rows and the
  ring share the program's shared memory (`shared_bytes`): where a program's whole K range
  of rows does not fit beside its ring (from 32 rows of a long K), it holds a rolling window
  of them (`x_tiles`);
- split-K as in kernels/small_gemm: fp32 partials to a workspace, a ticket per N tile drawn
  with an acq_rel atomic, the last split sums the partials in split order 0..S-1 and rounds
  once. Bitwise deterministic run to run; a CUDA graph replay equals eager. `unreduced`
  leaves the sum to the kernel that reads the output next (kernels/split_sums: no ticket and
  no reload on the GEMM's tail).

Measured on the H200 (benchmarks/results/2026-12-02-ws-gemm-h200.md), Ouro at M = 8, back to
back under PDL: qkv 7.8 us (Triton kernel 9.2, cuBLAS 10.1), o_proj 4.4 (5.2, 6.4), down_proj
8.6 (9.2, 11.9); decode in place +3% at c=1, +5% at c=8. The SwiGLU form (`swiglu`: gate and
up tiles in one ring stage, two wgmma a stage, the activation in the epilogue) takes Ouro's
packed gate/up: 15.3 vs 16.7 us alone at M = 8, +1% in place (2026-12-02-added-times-h200.md).
On Nanbeige's it lost 4% in place, in two waves of programs, until two programs shared an SM
(`two_per_sm`). Its 64-row tile (`halves`: 32 gate and 32 up rows in one MMA, met in shared
memory for the activation) gives Ouro's gate/up 176 programs where 128-row tiles give 88 on
132 SMs: on an H100 19.0 us alone at 1-8 rows against 19.9 (80-81% of the copy rate), and
in decode c=1 / 2 / 4 / 8 +2.1-2.2% / +2.0% / +2.6-2.9% / +1.2-1.4%
(2026-12-07-halves-gate-up-h100.md).

The packed qkv projection takes RoPE and the K/V write in its epilogue (`rope`, a QkvRope;
decode, through small_gemm.linear_rope): each program's weight tile is two half boxes (head
dims j*block_n/2.. and the same dims + D/2), so it holds whole RoPE pairs, rotates q and k as
kernels/rope_kv_write does, bit for bit, and writes the new K / V rows into the pools itself:
one launch and one PDL hop fewer between the GEMM and attention (c=1 +4%, c=8 +1.4%,
results/2026-12-03-qkv-rope-epilogue-h200.md).

Runs only on compute capability 9.0 (wgmma is sm_90a's), with Triton's Gluon, never under the
interpreter: `available` says whether. Chosen per shape by small_gemm's table (backend "ws");
no gate (the lm_head's skip stays on the Triton kernel). Kernel built on first use.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlt_engine.kernels import pdl as _pdl
from rlt_engine.kernels.split_sums import SplitSums

__all__ = ["QkvRope", "available", "check", "ws_gemm"]

MAX_M = 64  # the MMA's narrow side: 8, 16, 32 or 64 rows of x (`rows_tile`)
# a block's shared memory on sm_90 (227 KiB), which holds the ring, the x rows and the RoPE
# epilogue's exchange; SHARED_SLACK for the barriers and alignment
SHARED_LIMIT = 227 << 10
SHARED_SLACK = 1 << 10
# Up to X_BY_LOADS_ROWS rows the consumer warps copy the activation rows with cp.async, not
# TMA. Issued after the wait, the rows land only behind the weight tiles every program queued
# before them, but a few rows by cp.async sooner (the kernel clock at 1 row: the qkv's rows
# 0.5 us sooner, the layer 37.6 -> 36.6 us).
# c=1 / 2 / 4 +3.0% / +1.5% / +1.0%; c=8 / 16 -0.3% / -0.8% (5-7 rows not measured)
# (2026-12-04-rows-by-loads-h200.md)
X_BY_LOADS_ROWS = 4
# From RING_AHEAD_ROWS rows a program keeps at most RING_AHEAD_BYTES of weight tiles in flight
# (where that is less than its ring): at 8 rows only the qkv's 5-stage ring of 32 KiB tiles
# (3 in flight), c=8 +1.5% / +1.6% in two calls; from 1 row c=1 lost 2.1%, and 64 KiB lost
# 1.4-7.0% at c=1-8 (2026-12-04-rows-by-loads-h200.md)
RING_AHEAD_BYTES = 96 * 1024
RING_AHEAD_ROWS = 8
# From 2 rows the qkv GEMM with its RoPE epilogue releases attention at its end, not after its
# wait: attention's programs placed beside the qkv's cost 1.5% at c=8 and gained 1.8% at c=1
# (2026-12-03-qkv-rope-epilogue-h200.md). From more rows per packed qkv weight (N, K) where
# measured so: Ouro-1.4B's, with the add + norm's early release, on an H100 released after the
# wait c=2 +1.6%, c=4 / 8 -0.8% / -0.7% (2026-12-07-norm-release-early-h100.md). An A/B
# switch (ab_decode --set)
LATE_RELEASE_ROWS: dict[tuple[int, int], int] = {(6144, 2048): 4}
# From these rows a launch of this weight (N, K) without the RoPE epilogue releases at its end
# too; none does. An A/B switch for Nanbeige's down_proj (96 programs leave 36 SMs free): the
# add + norm after it, released early (norm_chain.RELEASE_EARLY_ROWS), then cannot launch the
# next qkv beside the down's stream (2026-12-07-attention-window-h100.md, section 3)
LATE_RELEASE_PLAIN_ROWS: dict[tuple[int, int], int] = {}
# Two programs an SM where a launch has more programs than SMs. Nanbeige's gate/up in the ws
# form takes 168 programs of 128 weight rows; at the whole register file (one program an SM)
# they ran on 132 SMs in two waves, a 19 us tail (2026-12-06-nanbeige-gate-up-timeline-h100.md).
# Launched at TWO_PER_SM_REGISTERS a thread (8 warps: half the register file) with at most
# HALF_SM_SHARED of shared memory, two share an SM and all are resident at once: Nanbeige
# decode +7% at c=8 against the same rows launched whole, and with its table's ws rows +1.2% to
# +1.9% at c=2-16 against the Triton kernel (2026-12-06-gate-up-two-per-sm-h100.md); Ouro's
# 64-row gate/up tiles (`halves`, 176 programs) +1.3-2.7% at c=1-8
# (2026-12-07-halves-gate-up-h100.md). Every form: the other table rows have at most 132
# programs (qkv 96, o_proj and down 128), so for them this decides only how the tuner's
# candidates with more run (split-K qkv, 8-split o_proj and down), not yet measured so
TWO_PER_SM = True
TWO_PER_SM_REGISTERS = 128
HALF_SM_SHARED = 113 << 10  # an SM's 228 KiB, less 1 KiB the hardware reserves a block, / 2
_DTYPES = (torch.bfloat16, torch.float16)
_KERNEL: list = []  # the @gluon.jit kernel, built on first use
_AVAILABLE: dict[int, bool] = {}


def available(device: torch.device) -> bool:
    """Whether `ws_gemm` runs on `device`: CUDA, compute capability 9.0, Gluon importable."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _AVAILABLE:
        ok = torch.cuda.get_device_capability(index) == (9, 0)
        if ok:
            from rlt_engine.kernels import paged_attention as _pa

            ok = _pa._import_triton() is None and not _pa._interpreter_mode()
        if ok:
            try:
                from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
                    warpgroup_mma,
                )
            except ImportError:
                ok = False
        _AVAILABLE[index] = ok
    return _AVAILABLE[index]


def rows_tile(m: int) -> int:
    """BM, the rows of x a program holds (the MMA's N): the next of 8, 16, 32, 64 from m."""
    return 8 if m <= 8 else 1 << (m - 1).bit_length()


def _shared(m: int, block_n: int, block_k: int, stages: int, exchange: bool, x_tiles: int) -> int:
    bm = rows_tile(m)
    scratch = block_n * bm if exchange else 0
    return 2 * (stages * block_n * block_k + x_tiles * bm * block_k + scratch) + SHARED_SLACK


def x_tiles(
    k: int,
    m: int,
    block_n: int,
    block_k: int,
    split_k: int,
    stages: int,
    exchange: bool = False,
    limit: int = SHARED_LIMIT,
) -> int:
    """The tiles [rows_tile(m), block_k] of x a program holds: its whole K range where that
    fits beside the ring within `limit`, else a rolling window of max(2, stages) tiles, each
    reloaded (from L2: every program reads the same rows) once the MMA that read it is done."""
    kt = k // (split_k * block_k)
    if _shared(m, block_n, block_k, stages, exchange, kt) <= limit:
        return kt
    return min(kt, max(2, stages))


def shared_bytes(
    k: int,
    m: int,
    block_n: int,
    block_k: int,
    split_k: int,
    stages: int,
    exchange: bool = False,
    limit: int = SHARED_LIMIT,
) -> int:
    """A program's shared memory: its ring of `stages` weight tiles [block_n, block_k] (the
    SwiGLU form's gate and up halves together), its x rows (`x_tiles` of them within
    `limit`), the epilogue's exchange [block_n, rows_tile(m)] where its tile's halves meet (the
    RoPE epilogue's, and `halves`') and SHARED_SLACK (16-bit elements)."""
    tiles = x_tiles(k, m, block_n, block_k, split_k, stages, exchange, limit)
    return _shared(m, block_n, block_k, stages, exchange, tiles)


def halves(swiglu: bool, block_n: int) -> bool:
    """The SwiGLU form's 64-row tile: 32 gate and the same 32 up rows in one MMA (two half
    boxes, as the RoPE form loads a head's halves), which meet in shared memory for the
    activation. Ouro's gate/up then has 176 programs, two an SM (`two_per_sm`), where its
    128-row tiles (64 of each) leave 44 of an H100's 132 SMs idle at 88 programs: its table's
    1-8-row rows."""
    return swiglu and block_n == 64


def two_per_sm(programs: int, sms: int, k: int, m: int, config, exchange: bool = False) -> bool:
    """Whether a launch runs two programs an SM (TWO_PER_SM): more programs than SMs, and a
    program's ring, rows and epilogue exchange (`exchange`: RoPE's or `halves`') within
    HALF_SM_SHARED."""
    if not (TWO_PER_SM and programs > sms):
        return False
    need = shared_bytes(
        k, m, config.block_n, config.block_k, config.split_k, config.num_stages, exchange,
        HALF_SM_SHARED,
    )  # fmt: skip
    return need <= HALF_SM_SHARED


def check(
    n: int,
    k: int,
    m: int,
    block_n: int,
    block_k: int,
    split_k: int,
    swiglu: bool = False,
    stages: int | None = None,
    rope: bool = False,
) -> str | None:
    """Why the kernel cannot take this shape and config, or None. `swiglu`: n counts the
    packed gate and up rows; a program takes block_n / 2 rows of each (32 of each in one MMA
    tile where block_n is 64: `halves`). `stages` (the ring's):
    also whether the ring, the x rows and the epilogue's exchange (`rope`'s, or `halves`')
    fit a block's shared memory."""
    if m > MAX_M:
        return f"at most {MAX_M} rows, got {m}"
    rows, n_out = (block_n // 2, n // 2) if swiglu else (block_n, n)
    if swiglu and (n % 2 or split_k != 1):
        # split-K (the last split applying the activation) ran 13-42% slower on the H200
        # alone, 5-14% in decode (results/2026-12-02-added-times-h200.md); its second form
        # (dc7a1eb, reverted) gave outputs that differed between launches and lay far outside
        # the rounding bound in the tuner on an H100, though its GPU test of one config passed
        # (results/2026-12-07-split-k-swiglu-reverted-h100.md): not offered
        return f"SwiGLU needs [gate; up] packed (an even N, got {n}) and no split-K"
    if rows not in ((32, 64, 128) if swiglu else (64, 128)) or n_out % rows:
        sizes = "32, 64 or 128 rows a part" if swiglu else "64 or 128 rows"
        return f"N = {n} must be a multiple of block_n ({sizes}), got {block_n}"
    if k % (split_k * block_k):
        return f"K = {k} must be a multiple of split_k * block_k = {split_k * block_k}"
    if stages is not None:
        exchange = rope or halves(swiglu, block_n)
        need = shared_bytes(k, m, block_n, block_k, split_k, stages, exchange)
        if need > SHARED_LIMIT:
            tiles = x_tiles(k, m, block_n, block_k, split_k, stages, exchange)
            epilogue = " and the epilogue's exchange" if exchange else ""
            return (
                f"{stages} stages of [{block_n}, {block_k}] beside {tiles} tiles of "
                f"{rows_tile(m)} rows{epilogue} need {need >> 10} KiB of shared memory, more "
                f"than {SHARED_LIMIT >> 10} KiB: fewer stages or a smaller tile"
            )
    return None


PROBE_FIELDS = (  # what a PROBE build stamps per program (%globaltimer ns), in this order
    "start",  # the consumer warps begin (before the PDL wait)
    "waited",  # their PDL wait returned
    "x_ready",  # the program's activation rows landed in shared memory
    "mma_done",  # the last MMA retired
    "end",  # output (or partial and, for the last split, the sum) stored
    "producer_start",  # the producer warp begins
    "ring_full",  # the ring's first min(STAGES, K tiles) weight tiles landed
    "last_issued",  # the producer issued its last weight tile
)


class QkvRope(NamedTuple):
    """The packed qkv projection's epilogue (decode): RoPE on its q and k heads in place and
    the new K / V rows written to the paged pools, as kernels/rope_kv_write.rope_write_kv_
    does after the GEMM. cos / sin [rows, D] in x's dtype (contiguous last dimension),
    k_pool / v_pool [slots, num_kv_heads, D] contiguous, slot_mapping [rows] int64."""

    cos: torch.Tensor
    sin: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    slot_mapping: torch.Tensor
    num_heads: int


def check_rope(n: int, block_n: int, rope: QkvRope, x: torch.Tensor) -> str | None:
    """Why the qkv epilogue cannot take this GEMM, or None."""
    _, kv_heads, d = rope.k_pool.shape
    rows = x.numel() // x.shape[-1]
    if (rope.num_heads + 2 * kv_heads) * d != n or d % block_n or block_n % 16:
        return (
            f"N = {n} must be (heads + 2 kv_heads) * D with D a multiple of block_n {block_n}"
            " (a multiple of 16: two half boxes of 8 rows or more)"
        )
    if rope.v_pool.shape != rope.k_pool.shape or not (
        rope.k_pool.is_contiguous() and rope.v_pool.is_contiguous()
    ):
        return "k_pool and v_pool must be contiguous [slots, kv_heads, D]"
    if any(t.dtype != x.dtype for t in (rope.cos, rope.sin, rope.k_pool, rope.v_pool)):
        return f"cos, sin and the pools must be {x.dtype}"
    for t in (rope.cos, rope.sin):
        if t.shape != (rows, d) or t.stride(-1) != 1:
            return f"cos / sin must be [{rows}, {d}] with a contiguous last dimension"
    if rope.slot_mapping.shape != (rows,) or rope.slot_mapping.dtype != torch.int64:
        return f"slot_mapping must be [{rows}] int64"
    return None


def refusal(
    x: torch.Tensor,
    w: torch.Tensor,
    config,
    swiglu: bool = False,
    rope: QkvRope | None = None,
    unreduced: bool = False,
) -> str | None:
    """Why `ws_gemm` refuses this shape and config (its ValueError), or None: callers with a
    route of their own (small_gemm.linear_rope, gate_up_swiglu) take it instead. A table row
    tuned without the RoPE exchange or the SwiGLU halves may not fit in their form."""
    n, k = w.shape
    m = x.numel() // max(1, k)
    c = config
    why = check(n, k, m, c.block_n, c.block_k, c.split_k, swiglu, c.num_stages, rope is not None)
    if why is None and rope is not None:
        why = "no SwiGLU form with RoPE" if swiglu else check_rope(n, c.block_n, rope, x)
    if why is None and unreduced and c.split_k > 1 and rope is not None:
        why = "unreduced partials are for the plain GEMM, not the RoPE epilogue"
    return why


class Launch(NamedTuple):
    """What `ws_gemm` launches for a shape and config (`launch`): the grid (N tiles, splits),
    the kernel's constexprs, the rows of a weight descriptor's box, and the register cap a
    thread (None: the whole register file)."""

    grid: tuple[int, int]
    constexprs: dict[str, object]
    box: int
    maxnreg: int | None


def launch(
    n: int,
    k: int,
    m: int,
    config,
    swiglu: bool = False,
    rope_d: int = 0,
    unreduced: bool = False,
    sms: int = 132,
    pdl: bool = True,
    probe: bool = False,
) -> Launch:
    """The launch of `ws_gemm` for w [n, k], m rows and `config` on a GPU of `sms` SMs: one
    place for what the kernel is specialised on, which the sm_90 compile tests build as the
    launch does. `rope_d`: the RoPE epilogue's head dim (0: none); `unreduced`: split-K
    partials left to the next kernel (with split-K only)."""
    bk, splits, stages = config.block_k, config.split_k, config.num_stages
    rope = rope_d > 0
    parts = 2 if swiglu else 1
    pair = halves(swiglu, config.block_n)  # one MMA of both halves: its rows are block_n
    bn = config.block_n // (1 if pair else parts)
    n_tiles = n // parts // (bn // 2 if pair else bn)  # output columns / those a program writes
    kt = k // (splits * bk)  # weight tiles a program streams
    exchange = rope or pair
    two = two_per_sm(n_tiles * splits, sms, k, m, config, exchange)
    xt = x_tiles(k, m, config.block_n, bk, splits, stages, exchange,
                 HALF_SM_SHARED if two else SHARED_LIMIT)  # fmt: skip
    constexprs = dict(
        ROPE=rope, D=rope_d or 1,
        LATE=m >= (LATE_RELEASE_ROWS.get((n, k), 2) if rope else
                   LATE_RELEASE_PLAIN_ROWS.get((n, k), MAX_M + 1)),
        KT=kt, XT=xt, BM=rows_tile(m), BN=bn, BK=bk, STAGES=stages, SPLIT=splits,
        PARTS=1 if pair else parts, HALVES=pair, PDL=pdl, PROBE=probe,
        UNREDUCED=unreduced and splits > 1,
        XLOAD=m <= X_BY_LOADS_ROWS and xt == kt,
        # (a SwiGLU stage counted twice: block_n has its gate and up rows. Its own bytes moved
        # the gate/up's rows from 8 rows, H200 c=8 / 16 / 32 +0.45% / +0.61% / -0.48%: kept
        # as the rows were tuned, results/2026-12-07-w2-prototype-and-ring-bound-h200.md)
        AHEAD=_ahead(parts * config.block_n * bk * 2, stages, m),  # 16-bit elements
    )  # fmt: skip
    # two half boxes a tile: RoPE's halves of head dims, or `halves`' gate and up rows
    box = bn // 2 if exchange else bn
    # launched with the whole register file (Triton's default here), so no other kernel's
    # program shares an SM with a GEMM program: at 80 registers a thread the down_proj's
    # programs started beside the gate/up's and streamed under it, c=8 -2.5%
    # (results/2026-12-03-split-sums-h200.md); the o_proj alone at 128, to sit beside
    # attention, gained nothing (results/2026-12-04-tail-h200.md). Where `two_per_sm`, half
    # of it: two programs an SM
    return Launch((n_tiles, splits), constexprs, box, TWO_PER_SM_REGISTERS if two else None)


def ws_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    config,
    swiglu: bool = False,
    probe: torch.Tensor | None = None,
    rope: QkvRope | None = None,
    unreduced: bool = False,
) -> torch.Tensor | SplitSums:
    """`x @ w.T` for x [..., K] with at most MAX_M rows, w [N, K] contiguous, one 16-bit dtype, on
    a device where `available`; config (a GemmConfig): block_n / block_k / split_k /
    num_stages. `swiglu`: w = [gate; up] packed [2I, K]; returns silu(x @ gate.T) * (x @ up.T)
    [..., I] with kernels/gate_up_swiglu's roundings (block_n / 2 rows of each a program, no
    split-K). `probe` (benchmarks): int64 [programs, len(PROBE_FIELDS)], programs in grid
    order (N tile major, then split): a PROBE build stamps each program's PROBE_FIELDS.
    `unreduced`: with split-K, each split stores its fp32 partial and the launch returns them
    as a SplitSums for the next kernel to sum (no ticket, no sum here: kernels/split_sums);
    without split-K the output as always."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    n, k = w.shape
    if x.dtype not in _DTYPES or w.dtype != x.dtype or x.shape[-1] != k or not w.is_contiguous():
        raise ValueError(
            f"x [..., {k}] and w [N, K] contiguous must share a dtype in {_DTYPES}, got x "
            f"{x.dtype} {tuple(x.shape)}, w {w.dtype} {tuple(w.shape)}"
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    m = x2.shape[0]
    bk, splits = config.block_k, config.split_k
    why = refusal(x, w, config, swiglu, rope, unreduced)
    if why is not None:
        raise ValueError(why)
    unreduced = unreduced and splits > 1  # (SwiGLU takes no split-K: `check`)
    if not available(x.device):
        raise RuntimeError(f"the warp-specialised GEMM does not run on {x.device}")
    pdl = _pdl.enabled(x.device)
    rope_d = 0 if rope is None else rope.k_pool.shape[-1]
    plan = launch(
        n, k, m, config, swiglu, rope_d, unreduced, _sms(x.device), pdl, probe is not None
    )
    n_tiles = plan.grid[0]
    n_out = n // 2 if swiglu else n
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n_out)
    gl_dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    # descriptors are built per call (the launcher encodes them at every launch anyway): one
    # kept would keep its tensor alive
    bn = plan.constexprs["BN"]
    w_layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gl_dtype)
    w_desc = TensorDescriptor.from_tensor(w, [plan.box, bk], w_layout)
    bm = plan.constexprs["BM"]
    x_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], gl_dtype)
    x_desc = TensorDescriptor.from_tensor(x2, [bm, bk], x_layout)
    from rlt_engine.kernels.small_gemm import split_buffers

    if probe is not None and probe.shape != (n_tiles * splits, len(PROBE_FIELDS)):
        raise ValueError(f"probe: int64 [{n_tiles * splits}, {len(PROBE_FIELDS)}]")
    if unreduced:
        partials = torch.empty((splits, m, n_out), dtype=torch.float32, device=x.device)
        counters = out
    else:
        partials, counters = split_buffers(n_tiles, splits, bn * bm, out)
    if rope is None:
        cos = sin = k_pool = v_pool = slots = out
        num_heads = kv_heads = 0
    else:
        cos, sin, k_pool, v_pool, slots, num_heads = rope
        kv_heads = k_pool.shape[1]
    _kernel()[plan.grid](
        x_desc, w_desc, out, partials, counters, m, n_out, out if probe is None else probe,
        x_ptr=x2, K=k,
        cos_ptr=cos, sin_ptr=sin, stride_cos=cos.stride(0), stride_sin=sin.stride(0),
        kpool_ptr=k_pool, vpool_ptr=v_pool, slot_ptr=slots, H=num_heads, KVH=kv_heads,
        **plan.constexprs,
        num_warps=4,
        **({} if plan.maxnreg is None else {"maxnreg": plan.maxnreg}),
        **_pdl.launch_options(pdl),
    )  # fmt: skip
    if unreduced:  # rows flattened: [splits, rows, N]
        return SplitSums(partials, x.dtype)
    return out.view(*lead, n_out)


def _ahead(tile_bytes: int, stages: int, m: int) -> int:
    """Weight tiles a program of an m-row launch keeps in flight at most (RING_AHEAD_BYTES'
    worth from RING_AHEAD_ROWS rows), 0 where that is the whole ring."""
    if not RING_AHEAD_BYTES or m < RING_AHEAD_ROWS:
        return 0
    ahead = max(1, -(-RING_AHEAD_BYTES // tile_bytes))
    return 0 if ahead >= stages else ahead


def _sms(device: torch.device) -> int:
    """The device's SM count (cached by torch)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def _kernel():
    if not _KERNEL:
        _KERNEL.append(_build())
    return _KERNEL[0]


def _build():
    """Define the Gluon kernel (needs triton's Gluon; see `available`)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.language.extra import libdevice

    @gluon.jit
    def gdc_wait():  # griddepcontrol, as triton.language.extra.cuda has it for Triton kernels
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip

    @gluon.jit
    def gdc_launch_dependents():
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip

    STRIDE = gl.constexpr(len(PROBE_FIELDS))  # a probe row's stamps

    @gluon.jit
    def now():  # %globaltimer, ns (PROBE builds): reads no memory
        return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                         is_pure=False, pack=1)  # fmt: skip

    @gluon.jit
    def stamp(probe_ptr, field: gl.constexpr, value):
        """PROBE builds: one stamp into this launch's own probe row (no other kernel reads or
        writes the probe, so the producer, which never waits, may write it)."""
        row = gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)
        gl.store(probe_ptr + row * STRIDE + field, value)

    @gluon.jit
    def swiglu(gate, up, dtype: gl.constexpr):
        """kernels/gate_up_swiglu's roundings: each projection rounded as stored, silu in fp32
        as torch's CUDA kernel computes it (expf, an IEEE division) and rounded, times up."""
        g = gate.to(dtype).to(gl.float32)
        silu = gl.div_rn(g, 1.0 + libdevice.exp(-g))
        return (silu.to(dtype).to(gl.float32) * up.to(dtype).to(gl.float32)).to(dtype)

    @gluon.jit
    def rope_mul(a, b):  # fp32 product by mul.rn: never contracted into an FMA (rope.py's)
        return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=gl.float32, is_pure=True, pack=1)  # fmt: skip

    # the RoPE epilogue's layout of a tile's half [BN / 2, BM]: a thread a (dim, row)
    ROPE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1], [32, 1], [1, 4], [0, 1]))

    @gluon.jit
    def rope_operands(cos_ptr, sin_ptr, stride_cos, stride_sin, slot_ptr, M, H, KVH,
                      BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr):  # fmt: skip
        """What the RoPE epilogue reads besides its tile: the rows' cos / sin at the tile's
        dims (q and k tiles only) and their K/V slots. Loaded right after the wait, so their
        round trip (from HBM: the layer's weight stream has evicted them from L2) overlaps
        the MMA loop instead of following it."""
        HB: gl.constexpr = BN // 2
        HALF: gl.constexpr = D // 2
        lay: gl.constexpr = ROPE_LAYOUT
        i = gl.arange(0, HB, layout=gl.SliceLayout(1, lay))[:, None]
        r = gl.arange(0, BM, layout=gl.SliceLayout(0, lay))[None, :]
        tile = gl.program_id(0)
        d = (tile % (D // BN)) * HB + i  # the dim of x1 within its head; x2's is d + HALF
        ok = (r < M) & (i >= 0) & (tile // (D // BN) < H + KVH)  # v tiles rotate nothing
        c1 = gl.load(cos_ptr + r * stride_cos + d, mask=ok, other=0.0).to(gl.float32)
        c2 = gl.load(cos_ptr + r * stride_cos + HALF + d, mask=ok, other=0.0).to(gl.float32)
        s1 = gl.load(sin_ptr + r * stride_sin + d, mask=ok, other=0.0).to(gl.float32)
        s2 = gl.load(sin_ptr + r * stride_sin + HALF + d, mask=ok, other=0.0).to(gl.float32)
        slot = gl.load(slot_ptr + r, mask=r < M, other=0)  # int64: the pool is large
        return c1, c2, s1, s2, slot

    @gluon.jit
    def tile_halves(val, scratch, dtype: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
        """A tile's (fp32 [BN, BM]) two halves [BN / 2, BM] in ROPE_LAYOUT, each rounded as the
        plain GEMM stores it, and their row (i) and column (r) indices. A pair's halves live in
        different warps: they meet in shared memory."""
        HB: gl.constexpr = BN // 2
        scratch.store(val.to(dtype))
        gl.thread_barrier()
        lay: gl.constexpr = ROPE_LAYOUT
        first = scratch.slice(0, HB).load(lay)
        second = scratch.slice(HB, HB).load(lay)
        i = gl.arange(0, HB, layout=gl.SliceLayout(1, lay))[:, None]
        r = gl.arange(0, BM, layout=gl.SliceLayout(0, lay))[None, :]
        return first, second, i, r

    @gluon.jit
    def rope_tile(val, scratch, out_ptr, N, M, operands, kpool_ptr, vpool_ptr, H, KVH,
                  BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr):  # fmt: skip
        """The qkv epilogue of one tile (fp32 [BN, BM], all M rows): its first BN / 2 weight
        rows are dims j*BN/2.. of head `head`, the others the same dims + D/2 (the producer's
        two half boxes), so the tile holds whole RoPE pairs. q / k dims rotated (k also to
        k_pool), v to v_pool; rope_kv_write's roundings step by step. `operands`: what
        rope_operands loaded."""
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        HB: gl.constexpr = BN // 2
        HALF: gl.constexpr = D // 2
        c1, c2, s1, s2, slot = operands
        x1, x2, i, r = tile_halves(val, scratch, dtype, BM, BN)
        tile = gl.program_id(0)
        head = tile // (D // BN)
        d = (tile % (D // BN)) * HB + i  # the dim of x1 within its head; x2's is d + HALF
        ok = (r < M) & (i >= 0)
        x_at = out_ptr + r * N + head * D + d
        if head < H + KVH:  # q or k: (x1*c1 - x2*s1, x2*c2 + x1*s2), products rounded
            f1, f2 = x1.to(gl.float32), x2.to(gl.float32)
            a1 = rope_mul(f1, c1).to(dtype).to(gl.float32)
            b1 = rope_mul(f2, s1).to(dtype).to(gl.float32)
            a2 = rope_mul(f2, c2).to(dtype).to(gl.float32)
            b2 = rope_mul(f1, s2).to(dtype).to(gl.float32)
            o1 = (a1 - b1).to(dtype)
            o2 = (a2 + b2).to(dtype)
            gl.store(x_at, o1, mask=ok)
            gl.store(x_at + HALF, o2, mask=ok)
            if head >= H:
                at = kpool_ptr + slot * (KVH * D) + (head - H) * D + d
                gl.store(at, o1, mask=ok)
                gl.store(at + HALF, o2, mask=ok)
        else:
            gl.store(x_at, x1, mask=ok)
            gl.store(x_at + HALF, x2, mask=ok)
            at = vpool_ptr + slot * (KVH * D) + (head - H - KVH) * D + d
            gl.store(at, x1, mask=ok)
            gl.store(at + HALF, x2, mask=ok)

    @gluon.jit
    def halves_tile(val, scratch, out_ptr, N, M, BM: gl.constexpr, BN: gl.constexpr):
        """The `halves` epilogue of one tile (fp32 [BN, BM]): its first BN / 2 rows are gate
        rows j*BN/2.. and the others the same up rows (the producer's two half boxes); each
        rounded as stored, they meet in shared memory for `swiglu`."""
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        HB: gl.constexpr = BN // 2
        gate, up, i, r = tile_halves(val, scratch, dtype, BM, BN)
        at = out_ptr + r * N + gl.program_id(0) * HB + i
        gl.store(at, swiglu(gate, up, dtype), mask=(r < M) & (i >= 0))

    @gluon.jit
    def producer(w_desc, ring, full, empty, N, probe_ptr, KT: gl.constexpr, BN: gl.constexpr,
                 BK: gl.constexpr, STAGES: gl.constexpr, PARTS: gl.constexpr,
                 HALVES: gl.constexpr, PROBE: gl.constexpr, ROPE: gl.constexpr, D: gl.constexpr,
                 AHEAD: gl.constexpr):  # fmt: skip
        if PROBE:
            stamp(probe_ptr, 5, now())
        n0 = gl.program_id(0) * BN
        k0 = gl.program_id(1) * (KT * BK)
        FIRST: gl.constexpr = STAGES if STAGES < KT else KT
        for i in range(KT):  # no PDL wait: the weights depend on no kernel
            s = i % STAGES
            if PROBE and i == FIRST:  # the first lap landed (this wait delays nothing the
                mbarrier.wait(full.index(FIRST - 1), 0)  # consumers have freed)
                stamp(probe_ptr, 6, now())
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # the first lap passes
            # tile i - AHEAD has landed (its slot's next lap is not issued yet); two tests, so a
            # build without the bound (AHEAD 0, a constexpr) has no branch at all
            if AHEAD > 0:  # noqa: SIM102
                if i >= AHEAD:
                    j = i - AHEAD
                    mbarrier.wait(full.index(j % STAGES), (j // STAGES) & 1)
            if ROPE or HALVES:  # two half boxes a tile
                HB: gl.constexpr = BN // 2
                if ROPE:  # dims j*BN/2.. of a head, then the same dims + D/2
                    lo = (n0 // D) * D + (n0 % D) // 2
                    hi = lo + D // 2
                else:  # `halves`: gate rows j*BN/2.., then the same up rows
                    lo = gl.program_id(0) * HB
                    hi = N + lo
                mbarrier.expect(full.index(s), 2 * w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(
                    w_desc, [lo, k0 + i * BK], full.index(s), ring.index(s).slice(0, HB)
                )
                tma.async_copy_global_to_shared(
                    w_desc, [hi, k0 + i * BK], full.index(s), ring.index(s).slice(HB, HB)
                )
            else:
                mbarrier.expect(full.index(s), PARTS * w_desc.block_type.nbytes)
                for p in gl.static_range(PARTS):  # SwiGLU: the gate rows, then the up rows
                    tma.async_copy_global_to_shared(
                        w_desc, [p * N + n0, k0 + i * BK], full.index(s), ring.index(s * PARTS + p)
                    )
        if PROBE:
            stamp(probe_ptr, 7, now())
            if FIRST == KT:  # the whole K range fits the ring: it is full when it lands
                mbarrier.wait(full.index(FIRST - 1), 0)
                stamp(probe_ptr, 6, now())

    @gluon.jit
    def consumer(x_desc, out_ptr, part_ptr, tick_ptr, M, N, probe_ptr, ring, xs, full,
                 empty, xbar, KT: gl.constexpr, XT: gl.constexpr, BM: gl.constexpr,
                 BN: gl.constexpr,
                 BK: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                 PARTS: gl.constexpr, HALVES: gl.constexpr, PDL: gl.constexpr,
                 PROBE: gl.constexpr,
                 scratch, cos_ptr, sin_ptr,
                 stride_cos, stride_sin, kpool_ptr, vpool_ptr, slot_ptr, H, KVH,
                 ROPE: gl.constexpr, D: gl.constexpr, LATE: gl.constexpr,
                 UNREDUCED: gl.constexpr, x_ptr, K, XLOAD: gl.constexpr):  # fmt: skip
        if PROBE:  # the start is stored after the wait: nothing is written before it
            started = now()
        if PDL:  # the activations come from the kernel before (kernels/pdl.py's protocol)
            gdc_wait()
            if not LATE:
                gdc_launch_dependents()
        if PROBE:
            stamp(probe_ptr, 0, started)
            stamp(probe_ptr, 1, now())
        k0 = gl.program_id(1) * (KT * BK)
        if XLOAD:  # few rows: by cp.async, 16 bytes a thread (rows >= M filled with zeros)
            TK: gl.constexpr = 32 if BK >= 256 else BK // 8
            xl: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TK, TK], [4, 1], [1, 0])
            r = gl.arange(0, BM, layout=gl.SliceLayout(1, xl))[:, None]
            c = gl.arange(0, BK, layout=gl.SliceLayout(0, xl))[None, :]
            for i in gl.static_range(KT):
                async_copy.async_copy_global_to_shared(
                    xs.index(i), x_ptr + r * K + k0 + i * BK + c, mask=(r < M) & (c >= 0)
                )
            async_copy.commit_group()
            async_copy.wait_group(0)
            fence_async_shared()
            gl.thread_barrier()
        elif XT < KT:  # a window of XT tiles, a barrier each (refilled in the MMA loop)
            for i in gl.static_range(XT):
                mbarrier.expect(xbar.index(i), x_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [0, k0 + i * BK], xbar.index(i),
                                                xs.index(i))  # fmt: skip
        else:
            mbarrier.expect(xbar, KT * x_desc.block_type.nbytes)
            for i in gl.static_range(KT):
                tma.async_copy_global_to_shared(x_desc, [0, k0 + i * BK], xbar, xs.index(i))
        if ROPE:  # in flight while the MMA loop runs
            operands = rope_operands(cos_ptr, sin_ptr, stride_cos, stride_sin, slot_ptr, M, H,
                                     KVH, BM, BN, D)  # fmt: skip
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16]
        )
        acc = gl.zeros([BN, BM], gl.float32, mma)
        acc_up = gl.zeros([BN, BM], gl.float32, mma)  # SwiGLU's up rows (else unused)
        if not XLOAD and XT == KT:
            mbarrier.wait(xbar, 0)
        if PROBE:
            stamp(probe_ptr, 2, now())
        for i in range(KT):
            s = i % STAGES
            if XT < KT:
                mbarrier.wait(xbar.index(i % XT), (i // XT) & 1)
                xt = xs.index(i % XT).permute([1, 0])
            else:  # the whole range (the window's code here cost c=8 1.4%: results/
                # 2026-12-06-nanbeige-m32-h100.md)
                xt = xs.index(i).permute([1, 0])
            mbarrier.wait(full.index(s), (i // STAGES) & 1)
            acc = warpgroup_mma(ring.index(s * PARTS), xt, acc, is_async=True)
            if PARTS == 2:
                acc_up = warpgroup_mma(ring.index(s * PARTS + 1), xt, acc_up, is_async=True)
                acc, acc_up = warpgroup_mma_wait(0, deps=[acc, acc_up])
            else:
                acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index(s))
            if XT < KT:  # noqa: SIM102  (the MMA that read tile i is done: refill its slot)
                if i + XT < KT:
                    slot = i % XT
                    mbarrier.expect(xbar.index(slot), x_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(x_desc, [0, k0 + (i + XT) * BK],
                                                    xbar.index(slot), xs.index(slot))  # fmt: skip
        if PROBE:
            stamp(probe_ptr, 3, now())
        rows = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))  # weight rows = output columns
        cols = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))  # x rows = output rows
        out = out_ptr + cols[None, :] * N + (gl.program_id(0) * BN + rows)[:, None]
        keep = (cols < M)[None, :] & (rows >= 0)[:, None]
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        if SPLIT == 1:
            if PARTS == 2:
                gl.store(out, swiglu(acc, acc_up, dtype), mask=keep)
            elif HALVES:
                halves_tile(acc, scratch, out_ptr, N, M, BM, BN)
            elif ROPE:
                rope_tile(acc, scratch, out_ptr, N, M, operands, kpool_ptr, vpool_ptr, H, KVH,
                          BM, BN, D)  # fmt: skip
            else:
                gl.store(out, acc.to(dtype), mask=keep)
        elif UNREDUCED:  # partials [split, M, N], summed by the next kernel (split_sums.py)
            gl.store(part_ptr + gl.program_id(1) * M * N + cols[None, :] * N
                     + (gl.program_id(0) * BN + rows)[:, None], acc, mask=keep)  # fmt: skip
        else:  # partials [tile, split, BN, BM]; the last split of a tile sums them
            tile = gl.program_id(0)
            offs = rows[:, None] * BM + cols[None, :]
            gl.store(part_ptr + (tile * SPLIT + gl.program_id(1)) * (BN * BM) + offs, acc)
            gl.thread_barrier()  # every thread's partial is written before the ticket is drawn
            ticket = gl.atomic_add(tick_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT - 1:
                total = gl.zeros([BN, BM], gl.float32, mma)
                for j in gl.static_range(SPLIT):  # fixed order: deterministic
                    # .cg: read at L2, where the other SMs' partials are (L1 is not coherent)
                    total += gl.load(part_ptr + (tile * SPLIT + j) * (BN * BM) + offs,
                                     cache_modifier=".cg")  # fmt: skip
                if ROPE:
                    rope_tile(total, scratch, out_ptr, N, M, operands, kpool_ptr, vpool_ptr, H,
                              KVH, BM, BN, D)  # fmt: skip
                else:
                    gl.store(out, total.to(dtype), mask=keep)
                gl.store(tick_ptr + tile, 0)  # ready for the next launch, which waits for this
        if PDL and LATE:  # the next kernel's programs are placed once this one's leave
            gdc_launch_dependents()
        if PROBE:
            stamp(probe_ptr, 4, now())

    @gluon.jit
    def ws_gemm_kernel(x_desc, w_desc, out_ptr, part_ptr, tick_ptr, M, N, probe_ptr,
                       KT: gl.constexpr, XT: gl.constexpr, BM: gl.constexpr,
                       BN: gl.constexpr, BK: gl.constexpr,
                       STAGES: gl.constexpr, SPLIT: gl.constexpr, PARTS: gl.constexpr,
                       HALVES: gl.constexpr,
                       PDL: gl.constexpr, PROBE: gl.constexpr, cos_ptr, sin_ptr, stride_cos,
                       stride_sin, kpool_ptr, vpool_ptr, slot_ptr, H, KVH, ROPE: gl.constexpr,
                       D: gl.constexpr, LATE: gl.constexpr,
                       UNREDUCED: gl.constexpr, x_ptr, K, XLOAD: gl.constexpr,
                       AHEAD: gl.constexpr):  # fmt: skip
        # N: output columns (SwiGLU, PARTS 2: the up rows start at N in the weight)
        ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES * PARTS, BN, BK], w_desc.layout)
        xs = gl.allocate_shared_memory(x_desc.dtype, [XT, BM, BK], x_desc.layout)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        if ROPE or HALVES:  # the epilogue's exchange of a tile's halves between warps
            scratch = gl.allocate_shared_memory(out_ptr.dtype.element_ty, [BN, BM], plain)
        else:
            scratch = gl.allocate_shared_memory(out_ptr.dtype.element_ty, [1, 1], plain)
        for s in gl.static_range(STAGES):
            mbarrier.init(full.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        if XT < KT:  # a barrier per tile of the window
            xbar = gl.allocate_shared_memory(gl.int64, [XT, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(XT):
                mbarrier.init(xbar.index(i), count=1)
        else:  # one for the whole range's tiles
            xbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(xbar, count=1)
        # fmt: off
        gl.warp_specialize(
            [
                (consumer, (x_desc, out_ptr, part_ptr, tick_ptr, M, N, probe_ptr, ring, xs,
                            full, empty, xbar, KT, XT, BM, BN, BK, STAGES, SPLIT, PARTS, HALVES,
                            PDL, PROBE,
                            scratch, cos_ptr, sin_ptr, stride_cos, stride_sin,
                            kpool_ptr, vpool_ptr, slot_ptr, H, KVH, ROPE, D, LATE,
                            UNREDUCED, x_ptr, K, XLOAD)),
                (producer, (w_desc, ring, full, empty, N, probe_ptr, KT, BN, BK, STAGES, PARTS,
                            HALVES, PROBE, ROPE, D, AHEAD)),
            ],
            [1],  # one producer warp
            [40],  # its registers: it only issues copies
        )
        # fmt: on

    return ws_gemm_kernel
