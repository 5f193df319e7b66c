"""Small-M weight GEMMs for decode: `linear(x, w) == x @ w.T` as one Triton launch.

At decode a layer's GEMMs have M = 1..64 rows against weights of 8-50 MB: the work is a weight
stream, and cuBLAS's small-M tiles reach ~2.8 TB/s of the H200's ~4.3. This kernel is laid out
for that stream:

- swap-AB: a program computes the transposed tile out.T[BLOCK_N, BLOCK_M] = w[BLOCK_N, k-range]
  @ x.T[k-range, BLOCK_M], so the weight tile is the MMA's large operand (wgmma on Hopper for
  BLOCK_N >= 64) and x, padded with zeros to BLOCK_M >= 16 rows, the small one;
- split-K: grid (N tiles, splits) puts enough programs on the SMs to keep the weight reads in
  flight when N alone gives too few tiles;
- a deterministic serial reduction in the same launch: each split writes its fp32 partial to a
  workspace and draws a ticket from its tile's counter (atomic add, acq_rel at GPU scope); the
  program that draws the last ticket sums the partials in split order 0, 1, .., S-1 (the same
  order whichever program arrives last), rounds once to the output dtype, and resets the counter.
  Results are therefore bitwise run-to-run deterministic, and a CUDA graph replay equals eager.

The counters are one zeroed int32 buffer per device that every launch leaves zero, so launches
must not run concurrently on two streams of one device (the engine runs one stream at a time).

`linear` chooses per shape from the GPU's table (kernels/small_gemm_tables: `pick_table`), keyed
by (N, K, M bucket, dtype) and autotuned per GPU model by benchmarks/bench_small_gemm.py: this
kernel, or on Hopper the warp-specialised one (kernels/ws_gemm.py, entries "ws"), or
cuBLAS. It falls back to `F.linear` (cuBLAS) for shapes not in the table, entries that say
"cublas", a GPU no table serves, CPU tensors, M > 64, autograd, a "ws" entry where that kernel
cannot run, or RLT_SMALL_GEMM=0. fp32 is never in the table: fp32 outputs stay cuBLAS's.
`linear_argmax` is the greedy head: the lm_head GEMM whose epilogue keeps only each row's first
best logit of its N tile (kernels/argmax's partials, which the decode traversal's advance
reduces), so the logits are never written and the argmax's launch is gone.
CUDA-graph capturable: no host synchronisation; the grid and workspace depend on shapes only.
triton is imported lazily (see paged_attention: interpreter mode and its workarounds).

Measured on the H200 (benchmarks/results/2026-12-01-small-gemm-h200.md): inside CUDA graphs
3-11% faster than cuBLAS on the long-K GEMMs (down_proj, Nanbeige o_proj) and the lm_heads at
small M, a tie on the wide-N ones, slower at M = 64. Eagerly a launch costs tens of us of host
time (Triton's launcher), more than cuBLAS: the table is chosen for the graph-replayed decode.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlt_engine.kernels import argmax as _argmax
from rlt_engine.kernels import paged_attention as _pa
from rlt_engine.kernels import pdl as _pdl
from rlt_engine.kernels import rope as _rope
from rlt_engine.kernels.paged_attention import supported
from rlt_engine.kernels.split_sums import SplitSums

__all__ = [
    "MAX_M",
    "GemmConfig",
    "choose",
    "dispatch_mode",
    "gemm",
    "linear",
    "linear_argmax",
    "lookup",
    "m_bucket",
    "split_buffers",
    "supported",
    "table_key",
]

# set by _import_triton(); the kernel's body reads the module globals `tl`, `round_bf16`,
# `prefetch_l2` and `first_best`
triton = tl = round_bf16 = prefetch_l2 = first_best = None

MAX_M = 64
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# rows up to which `linear(..., prefetch_whole=True)` takes the Triton kernel: cuBLAS's 64-row
# tile is faster alone from 32 rows on (H200 table: Ouro o_proj 7.2 vs 6.4 us at 32)
PREFETCH_WHOLE_MAX_M = 16
_COUNTERS_PER_DEVICE = 1 << 16  # N tiles a launch may have (N <= 4M at BLOCK_N = 64)
# A/B switch for benchmarks: "0" cuBLAS everywhere, "1" the table, "triton" the table's kernel
# config (Triton or ws) wherever it has one (also where its entry says cuBLAS is a little faster)
_MODE = os.environ.get("RLT_SMALL_GEMM", "1")
_DISABLED = _MODE == "0"
_PREFER_TRITON = _MODE == "triton"


def dispatch_mode(device: torch.device) -> str:
    """What `linear` dispatches by on `device`: "cublas" (RLT_SMALL_GEMM=0, or no table for
    this device: not CUDA, another GPU layout or Triton version; see `table_applies`), else
    "table" (or "triton" with RLT_SMALL_GEMM=triton), with "+ws" where the table has rows for
    the warp-specialised kernel and it runs here."""
    entries = None if _DISABLED or device.type != "cuda" else _table_for(device)
    if entries is None:
        return "cublas"
    mode = "triton" if _PREFER_TRITON else "table"
    if any(row[0] == "ws" for row in entries.values()) and _ws_available(device):
        mode += "+ws"
    return mode


@dataclass(frozen=True)
class GemmConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    # "triton": this module's kernel; "ws": kernels/ws_gemm's warp-specialised one (Hopper,
    # no gate; num_warps unused)
    kernel: str = "triton"

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


def m_bucket(m: int) -> int:
    """Table key for m rows: the next power of two (a config tuned at 8 rows serves 5..8)."""
    return 1 << max(0, m - 1).bit_length()


def table_key(n: int, k: int, m: int, dtype: torch.dtype) -> str:
    """The table's key for an [m, k] @ [n, k].T GEMM, e.g. "6144x2048:m8:bfloat16"."""
    return f"{n}x{k}:m{m_bucket(m)}:{str(dtype).removeprefix('torch.')}"


# -- dispatch -------------------------------------------------------------------------------------

_TABLES: dict[int, dict | None] = {}  # device index -> the table's entries for that GPU, or None
_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


def _table_for(device: torch.device) -> dict | None:
    """The entries of the table that serves `device` (cached per GPU), or None."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _TABLES:
        table = serving_table(torch.device("cuda", index))
        _TABLES[index] = None if table is None else table.get("entries", {})
    return _TABLES[index]


def serving_table(device: torch.device) -> dict | None:
    """The small_gemm_tables table `device` takes (`pick_table`), or None (cuBLAS)."""
    from rlt_engine.kernels.small_gemm_tables import TABLES

    if device.type != "cuda" or not supported(device)[0]:
        return None
    props = torch.cuda.get_device_properties(device)
    layout = f"{props.major}.{props.minor}", props.multi_processor_count
    return pick_table(TABLES, props.name, *layout, _triton_version())


def pick_table(
    tables: tuple[dict, ...], name: str, capability: str, sms: int, triton_version: str | None
) -> dict | None:
    """The table tuned on the GPU called `name`, else the first of its layout (`table_applies`),
    else None."""
    own_first = sorted(tables, key=lambda t: t.get("device") != name)  # a stable sort
    return next(
        (t for t in own_first if table_applies(t, name, capability, sms, triton_version)), None
    )


def table_applies(
    table: dict, name: str, capability: str, sms: int, triton_version: str | None
) -> bool:
    """Whether `table` serves a GPU: the same Triton, and the GPU it was tuned on or one of the
    same architecture and SM count (an H100 SXM takes the H200's: the same kernels fill the
    same 132 SMs; only the bytes come at another rate)."""
    if table.get("triton") != triton_version:
        return False
    same_layout = (table.get("capability"), table.get("sms")) == (capability, sms)
    return table.get("device") == name or same_layout


def tuned_for(device: torch.device) -> bool:
    """Whether a measured table (small_gemm_tables) serves `device` (`pick_table`). Elsewhere
    every GEMM takes cuBLAS."""
    return device.type == "cuda" and _table_for(device) is not None


def _triton_version() -> str | None:
    try:
        import triton as triton_module
    except ImportError:
        return None
    return triton_module.__version__


def choose(x: torch.Tensor, w: torch.Tensor, gated: bool = False) -> GemmConfig | None:
    """The table's Triton config for `x @ w.T`, or None for cuBLAS. `gated`: the kernel's
    config even where cuBLAS is a little faster (a gate that skips the work wins more)."""
    if _DISABLED or x.device.type != "cuda" or w.dim() != 2 or x.dim() < 1:
        return None
    n, k = w.shape
    if x.shape[-1] != k or x.dtype != w.dtype or not w.is_contiguous() or x.numel() == 0:
        return None
    m = x.numel() // k
    if m > MAX_M or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return None
    entries = _table_for(x.device)
    return None if entries is None else lookup(entries, n, k, m, x.dtype, gated or _PREFER_TRITON)


def lookup(
    entries: dict, n: int, k: int, m: int, dtype: torch.dtype, gated: bool = False
) -> GemmConfig | None:
    """The kernel config the table's entries give for [m, k] @ [n, k].T, or None (cuBLAS).
    `gated`: the fastest kernel's config even where the row says cuBLAS."""
    row = entries.get(table_key(n, k, m, dtype))  # small_gemm_tables.FIELDS
    if row is None or (row[0] == "cublas" and not gated):
        return None
    return GemmConfig(*row[1:6], kernel="ws" if row[0] == "ws" else "triton")


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    gate: torch.Tensor | None = None,
    prefetch_whole: bool = False,
    unreduced: bool = False,
) -> torch.Tensor | SplitSums:
    """`F.linear(x, w)` (no bias): x [..., K], w [N, K] -> [..., N], through the Triton kernel
    where the table says it beats cuBLAS, else through cuBLAS.

    `gate` (a one-element device tensor): where the Triton kernel runs, a zero gate skips the
    GEMM and leaves the output's contents undefined; the caller must not read it then. Without
    a Triton config the GEMM simply runs (the same values, no saving).

    `prefetch_whole`: the caller's word that the kernel before this GEMM leaves the HBM mostly
    idle (decode attention before the o_proj): under PDL the launch then streams its whole
    weight into L2 while that kernel runs, and it takes the Triton kernel (which can) up to
    PREFETCH_WHOLE_MAX_M rows even where cuBLAS alone is a little faster.

    `unreduced`: the caller's word that it can take a kernels/split_sums.SplitSums (rows
    flattened) where the table runs the warp-specialised kernel with split-K (norm_chain's
    add_rms_norm sums it); elsewhere the output as always."""
    whole = prefetch_whole and x.numel() <= PREFETCH_WHOLE_MAX_M * w.shape[-1]
    config = choose(x, w, gated=gate is not None or whole)
    if config is None or (config.kernel == "ws" and not _ws_available(x.device)):
        return F.linear(x, w)
    return gemm(x, w, config, gate, prefetch_whole=whole, unreduced=unreduced)


def linear_argmax(
    x: torch.Tensor, w: torch.Tensor, gate: torch.Tensor | None = None
) -> _argmax.Partials:
    """The argmax of each row of `F.linear(x, w)` (x [rows, K]) as kernels/argmax's partials:
    from this kernel's epilogue where the table gives it a config without split-K (the logits
    are never written), else the logits' (`linear`) through `argmax.argmax_partials`. `gate` as
    in `linear`: a zero gate leaves the partials undefined."""
    config = choose(x, w, gated=True)
    if config is not None and config.kernel == "triton" and _split_k(w.shape[1], config)[1] == 1:
        return gemm(x, w, config, gate, argmax=True)
    return _argmax.argmax_partials(linear(x, w, gate), gate)


def linear_rope(x: torch.Tensor, w: torch.Tensor, rope) -> torch.Tensor | None:
    """`linear` of a packed qkv weight with kernels/ws_gemm's RoPE + K/V write epilogue
    (`rope`: a ws_gemm.QkvRope), or None where the table picks no warp-specialised config
    for it or the epilogue cannot take that config's tiles: the caller then projects and
    rotates as before."""
    config = choose(x, w)
    if config is None or config.kernel != "ws" or not _ws_available(x.device):
        return None
    from rlt_engine.kernels import ws_gemm as _ws

    if _ws.refusal(x, w, config, rope=rope) is not None:
        return None
    return _ws.ws_gemm(x, w, config, rope=rope)


# -- launch ---------------------------------------------------------------------------------------


def gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    config: GemmConfig,
    gate: torch.Tensor | None = None,
    prefetch_whole: bool = False,
    unreduced: bool = False,
    argmax: bool = False,
) -> torch.Tensor | SplitSums | _argmax.Partials:
    """`x @ w.T` with the kernel of an explicit config (tests, the benchmark): x [..., K] with at
    most MAX_M rows, w [N, K] contiguous, both of one float dtype, on one device. `gate`,
    `prefetch_whole`, `unreduced`: see `linear` (the "ws" kernel always runs the GEMM and
    streams its weights ahead of the PDL wait by itself; only it leaves partials unreduced).
    `argmax` (this kernel without split-K): each row's argmax partials instead of the output
    (one split per N tile; see `linear_argmax`)."""
    if argmax and (config.kernel != "triton" or _split_k(w.shape[-1], config)[1] != 1):
        raise ValueError(f"the argmax epilogue needs the Triton kernel without split-K: {config}")
    if config.kernel == "ws":
        from rlt_engine.kernels.ws_gemm import ws_gemm

        return ws_gemm(x, w, config, unreduced=unreduced)
    if x.dtype not in _DTYPES or w.dtype != x.dtype or w.dim() != 2 or x.dim() < 1:
        raise ValueError(
            f"x [..., K] and w [N, K] must share a dtype in {_DTYPES}, got x {x.dtype} "
            f"{tuple(x.shape)}, w {w.dtype} {tuple(w.shape)}"
        )
    n, k = w.shape
    if x.shape[-1] != k or x.device != w.device or not w.is_contiguous():
        raise ValueError(
            f"need x [..., {k}] on {w.device} and w contiguous, got x {tuple(x.shape)} on "
            f"{x.device}, w contiguous={w.is_contiguous()}"
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > MAX_M:
        raise ValueError(f"at most {MAX_M} rows, got {m}")
    if gate is not None and (gate.numel() != 1 or gate.device != x.device):
        raise ValueError(f"gate must be one element on {x.device}, got {tuple(gate.shape)}")
    if argmax:
        if m == 0 or n == 0 or k == 0:
            raise ValueError(f"the argmax epilogue needs rows, columns and K, got {m}x{n}x{k}")
        if len(lead) != 1:
            raise ValueError(f"the argmax epilogue takes x [rows, K], got {tuple(x.shape)}")
    # with the argmax epilogue only the dtype the logits round to: the partials replace them
    out = torch.empty((1, 1) if argmax else (m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    if k == 0:
        return out.zero_().view(*lead, n)
    interpret = _ready(x.device)

    bn, bk = config.block_n, config.block_k
    block_m = max(16, triton.next_power_of_2(m))  # tl.dot needs >= 16 on every side
    n_tiles = triton.cdiv(n, bn)
    k_per_split, splits = _split_k(k, config)
    workspace, counters = split_buffers(n_tiles, splits, m * bn, out)
    partials = None
    if argmax:
        partials = _argmax.Partials(
            torch.empty((m, n_tiles), dtype=torch.float32, device=x.device),
            torch.empty((m, n_tiles), dtype=torch.int32, device=x.device),
        )
    pdl = _pdl.enabled(x.device)
    # a gated launch does not prefetch: where the gate is zero those bytes would be wasted
    prefetch_k = 0
    if pdl and gate is None:
        prefetch_k = (
            k_per_split
            if prefetch_whole
            else _pdl.prefetch_k(n, splits, k_per_split, bk, x.element_size())
        )
    kernel = _compiled(interpret)
    with _pa._on_device(x.device):
        kernel[(n_tiles, splits)](
            x2,
            w,
            out,
            workspace,
            counters,
            out if gate is None else gate,
            *(partials or (out, out)),
            m,
            n,
            k,
            x2.stride(0),
            out.stride(0),
            k_per_split,
            prefetch_k,
            BLOCK_M=block_m,
            BLOCK_N=bn,
            BLOCK_K=bk,
            SPLIT=splits > 1,
            GATED=gate is not None,
            ARGMAX=argmax,
            EVEN_N=n % bn == 0,
            EVEN_K=k % bk == 0,
            UPCAST=interpret and x.dtype != torch.float32,
            ROUND_BF16=interpret and x.dtype == torch.bfloat16,
            PDL=pdl,
            LINE=_pdl.LINE_BYTES // x.element_size(),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **_pdl.launch_options(pdl),
        )
    return partials if argmax else out.view(*lead, n)


def _split_k(k: int, config: GemmConfig) -> tuple[int, int]:
    """(K columns per split, a multiple of BLOCK_K; splits, none empty) of a launch of
    `config` over K = k; one split for K = 0."""
    if k == 0:
        return 0, 1

    def cdiv(a: int, b: int) -> int:
        return (a + b - 1) // b

    k_per_split = cdiv(cdiv(k, max(1, config.split_k)), config.block_k) * config.block_k
    return k_per_split, cdiv(k, k_per_split)


def split_buffers(n_tiles: int, splits: int, tile: int, out: torch.Tensor):
    """Split-K's fp32 partials ([n_tiles, splits, tile]) and the device's ticket counters; with
    no split, `out` for both (the kernel does not touch them)."""
    if splits == 1:
        return out, out
    if n_tiles > _COUNTERS_PER_DEVICE:
        raise ValueError(f"{n_tiles} N tiles exceed the {_COUNTERS_PER_DEVICE} counters")
    partials = torch.empty(n_tiles * splits * tile, dtype=torch.float32, device=out.device)
    return partials, _counters(out.device)


def _ws_available(device: torch.device) -> bool:
    from rlt_engine.kernels.ws_gemm import available

    return available(device)


_READY: dict[torch.device, bool] = {}  # device -> interpreter mode, once it can run there


def _ready(device: torch.device) -> bool:
    """Raise unless the kernel can run on `device`; whether it runs interpreted. Cached: the
    checks cost more host time than the launch of a decode-sized GEMM."""
    if device not in _READY:
        ok, why = supported(device)
        if not ok:
            raise RuntimeError(f"Triton small GEMM cannot run on {device}: {why}")
        _import_triton()
        _READY[device] = _pa._interpreter_mode()
    return _READY[device]


_JIT: list = []


def _compiled(interpret: bool):
    """The kernel; compiled without specialising on M (triton would otherwise build separate
    binaries for M == 1 and M % 16 == 0: three per config for the decode buckets)."""
    if interpret:
        return _pa._kernel(_small_gemm_kernel, interpret)
    if not _JIT:
        from triton.runtime.jit import JITFunction

        _JIT.append(JITFunction(_small_gemm_kernel, do_not_specialize=["M"]))
    return _JIT[0]


def _counters(device: torch.device) -> torch.Tensor:
    """The device's ticket counters (all zero between launches). Allocated on first use, which
    the engine's warm-up does before any graph capture."""
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    key = (device.type, index)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(_COUNTERS_PER_DEVICE, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def _import_triton() -> None:
    global triton, tl, round_bf16, prefetch_l2, first_best
    _rope._import_triton()
    _pdl._import_triton()
    _argmax._import_triton()
    triton, tl, round_bf16, prefetch_l2 = _pa.triton, _pa.tl, _rope.round_bf16, _pdl.prefetch_l2
    first_best = _argmax.first_best


# ----------------------------------------------------------------------------------------------
# Kernel (a plain function; see paged_attention._kernel). Annotations are strings (future
# import), which triton reads as constexpr markers, so defining it needs no triton.


def _small_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    ws_ptr,  # fp32 partials [n_tiles, splits, M, BLOCK_N] (SPLIT only)
    count_ptr,  # int32 ticket counter per N tile, zero between launches (SPLIT only)
    gate_ptr,  # one element: 0 = skip the whole GEMM (GATED only)
    best_ptr,  # out (ARGMAX, instead of out_ptr): fp32 [M, n_tiles], each row's tile best
    best_i_ptr,  # out (ARGMAX): int32 [M, n_tiles], its index
    M,
    N,
    K,
    stride_xm,
    stride_om,
    k_per_split,  # a multiple of BLOCK_K
    prefetch_k,  # PDL: columns of its weight rows each program prefetches before the wait
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    GATED: tl.constexpr,
    ARGMAX: tl.constexpr,  # not SPLIT: store each row's first best of the tile, not the tile
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: its bf16 dot is wrong; fp32 products are exact
    ROUND_BF16: tl.constexpr,  # round to bf16 by hand (interpreter: its fp32->bf16 truncates)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
    LINE: tl.constexpr,  # elements per 128-byte line (PDL's prefetch)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    splits = tl.num_programs(1)
    rows = tl.arange(0, BLOCK_N)  # weight rows = output columns of this tile
    cols = tl.arange(0, BLOCK_M)  # x rows = output rows
    n0 = pid_n * BLOCK_N
    n_ok = (n0 + rows) < N
    m_ok = cols < M
    w_tile = w_ptr + n0.to(tl.int64) * K  # 64-bit base: N * K may pass 2^31 (int32 in-tile)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if PDL:  # the weights depend on no kernel: start their stream, then wait (kernels/pdl.py)
        prefetch_l2(w_tile, rows, n_ok, K, k_lo, tl.minimum(k_lo + prefetch_k, k_hi), BLOCK_K, LINE)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if GATED:  # noqa: SIM102  (a constexpr test, then a runtime one)
        if tl.load(gate_ptr) == 0:  # every program of every split returns: counters stay 0
            return
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = w_tile + rows[:, None] * K + ks[None, :]
        x_ptrs = x_ptr + cols[None, :] * stride_xm + ks[:, None]
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            if EVEN_N:  # noqa: SIM108  (constexpr branches: only one is compiled)
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = ks < K
            xt = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:  # ieee: fp32 inputs never use tf32 (ignored for 16-bit inputs)
            acc = tl.dot(w, xt, acc, input_precision="ieee")

    out_ptrs = out_ptr + cols[None, :] * stride_om + (n0 + rows)[:, None]
    out_mask = m_ok[None, :] & n_ok[:, None]
    if SPLIT:
        part = cols[None, :] * BLOCK_N + rows[:, None]
        tile_ws = ws_ptr + (pid_n * splits).to(tl.int64) * (M * BLOCK_N)
        tl.store(tile_ws + pid_k * (M * BLOCK_N) + part, acc, mask=m_ok[None, :])
        tl.debug_barrier()  # every thread's partial is written before the ticket is drawn
        ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == splits - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(0, splits):  # fixed order: deterministic whoever arrives last
                # .cg: read at L2, where the other SMs' partials are (L1 is not coherent)
                p = tl.load(
                    tile_ws + s * (M * BLOCK_N) + part,
                    mask=m_ok[None, :],
                    other=0.0,
                    cache_modifier=".cg",
                )
                total += p
            if ROUND_BF16:
                total = round_bf16(total)
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next launch (graph replay)
    else:
        if ROUND_BF16:
            acc = round_bf16(acc)
        logits = acc.to(out_ptr.dtype.element_ty)
        if ARGMAX:  # the values the logits would hold, as kernels/argmax reads them
            values = tl.where(n_ok[:, None], logits.to(tl.float32), float("-inf"))
            index = tl.broadcast_to((n0 + rows)[:, None], (BLOCK_N, BLOCK_M))
            best, at = first_best(values, index, 2**31 - 1)  # per output row, over the tile
            n_tiles = tl.num_programs(0)
            tl.store(best_ptr + cols * n_tiles + pid_n, best, mask=m_ok)
            tl.store(best_i_ptr + cols * n_tiles + pid_n, at, mask=m_ok)
        else:
            tl.store(out_ptrs, logits, mask=out_mask)
