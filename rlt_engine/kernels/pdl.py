"""Programmatic dependent launch (PDL) for the decode traversal's Triton kernels (sm_90+).

A decode traversal is ~265 short kernels in a row. Between two of them the GPU idles for the
launch, and each weight GEMM then ramps its stream up from nothing: the Ouro o_proj reads 8 MB
in 6.3 us where the copy rate would take 2. With PDL (CUDA's programmatic stream
serialization) a kernel's programs are placed on the SMs while its predecessor still runs; they
do what needs nothing from it (the GEMMs ask L2 to prefetch their first weight tiles, the
o_proj after decode attention its whole weight; decode attention asks for its K/V rows), then
wait until the predecessor has completed and its writes are visible, and only then release
their own successor and compute. The weight stream thus continues through the small kernels
(norms, RoPE, attention) that sit between the GEMMs.

The protocol every kernel launched with PDL keeps, which is what keeps it exact:
- nothing is written and nothing another kernel writes is read before `gdc_wait`, with one
  exception: decode attention's K/V prefetch reads the block table, seq_lens and
  query_start, which its caller vouches the kernel just before does not write (every kernel
  before that one has completed once this one's programs run, by the next rule); the L2
  prefetches themselves are hints, coherent whatever they touch. Model parameters, which no
  kernel writes, may be read before the wait (the GEMMs' weight tiles, the add + norm's
  weights), and so may what only the host writes (prefill attention's query_start, uploaded
  before the wave's first kernel);
- every program executes `gdc_wait`, even one that returns early (a gated GEMM), unless some
  other program of every launch does (a prefill attention block past its sequence's queries
  leaves before the wait; some sequence of a wave always has queries): a kernel then
  completes only after its predecessor has, so completion stays transitive down the chain;
- successors are released (`gdc_launch_dependents`) only after the wait: at most one kernel
  runs ahead, so prefetches do not pile up in L2. A kernel may release later than right after
  its wait (`if PDL and not LATE:` inside the wait's block, `if PDL and LATE:` at its end:
  the qkv GEMM with its RoPE epilogue, whose successor's programs are better placed once its
  own leave); a late release is always safe. One kernel releases before its wait: the add +
  norm between two GEMMs (norm_chain.RELEASE_EARLY_ROWS: Ouro's), so that the next GEMM's
  programs take the SMs the GEMM before leaves and stream their weight rings while the add +
  norm still waits. That is safe too: the next GEMM reads nothing but weights before its own
  wait, which returns only once the add + norm has completed, after its own wait. Two kernels
  then run ahead of a GEMM's tail, never more (the GEMMs release after their waits).
Kernels launched without PDL (cuBLAS, torch's) keep full stream order on both sides. The
arithmetic is unchanged, so outputs are the same bits with PDL on or off.

On CUDA devices of compute capability >= 9 only (never under the interpreter, which runs on
CPU tensors); RLT_PDL=0 turns it off for A/B runs. CUDA-graph capture keeps the programmatic
edges (CUDA >= 12.3). RLT_PDL_PREFETCH_MB sets the L2 prefetch budget of one GEMM launch.
"""

from __future__ import annotations

import os

import torch

__all__ = ["enabled", "launch_options", "prefetch_k"]

_DISABLED = os.environ.get("RLT_PDL", "1") == "0"
# bytes of weight one GEMM launch prefetches into L2 before its wait. Measured on the H200
# (benchmarks/results/2026-12-01-pdl-h200.md): 2 MB is best; 16-40 MB lose to none at all (the
# predecessor's own weight stream evicts the lines before they are used)
PREFETCH_BYTES = int(float(os.environ.get("RLT_PDL_PREFETCH_MB", "2")) * (1 << 20))
LINE_BYTES = 128  # one L2 prefetch request per 128-byte line

_CAPABLE: dict[int, bool] = {}


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (and compile their PDL branch)."""
    if _DISABLED or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _CAPABLE[index]


def launch_options(on: bool) -> dict[str, bool]:
    """Extra launch keywords for a Triton kernel launched with PDL `on`."""
    return {"launch_pdl": True} if on else {}


def prefetch_k(n_rows: int, programs_per_row: int, k_range: int, block_k: int, elt: int) -> int:
    """Columns (a multiple of block_k, at most k_range) each program of a GEMM over `n_rows`
    weight rows prefetches: PREFETCH_BYTES spread over the launch, at least one K tile."""
    if PREFETCH_BYTES <= 0:
        return 0
    per_program = PREFETCH_BYTES // max(1, n_rows * programs_per_row * elt)
    return min(k_range, max(block_k, per_program // block_k * block_k))


# the @jit forms of _prefetch_l2, _prefetch_lines, _clocks and _clock_after, set by
# _import_triton()
prefetch_l2 = prefetch_lines = clocks = clock_after = None
tl = None
PROBE_CLOCKS = 2  # what `clocks` returns: the global ns timer, the SM's cycle counter


def _import_triton() -> None:
    global prefetch_l2, prefetch_lines, clocks, clock_after, tl
    from rlt_engine.kernels import paged_attention as _pa

    _pa._import_triton()
    tl = _pa.tl
    if prefetch_l2 is None:
        prefetch_lines = _pa._kernel(_prefetch_lines, _pa._interpreter_mode())
        prefetch_l2 = _pa._kernel(_prefetch_l2, _pa._interpreter_mode())
        clocks = _pa._kernel(_clocks, _pa._interpreter_mode())
        clock_after = _pa._kernel(_clock_after, _pa._interpreter_mode())


def _clocks():
    """(%globaltimer ns, %clock64 cycles) now: the global timer orders programs across SMs and
    kernels, the SM's cycle counter times the phases within a program. Reads no memory (the
    PDL protocol allows it before the wait). For PROBE builds only: compiled, never
    interpreted."""
    ns = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    cycles = tl.inline_asm_elementwise(
        "mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    return ns, cycles


def _clock_after(dep):
    """The global ns timer once `dep` (a 32-bit value computed from loaded data) is in a
    register: a stamp that cannot be read before the loads it follows have landed, which
    %globaltimer alone can (the timer read does not wait for outstanding loads). PROBE
    builds only."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer; // $1", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1
    )


def _prefetch_l2(tile_ptr, rows, row_ok, K, k_lo, k_end, BLOCK_K: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for the weight lines of rows `rows` (those with row_ok) of a row-major [*, K]
    tile at `tile_ptr`, columns [k_lo, k_end): one fire-and-forget request per LINE elements.
    Compiled (PDL) only: the interpreter has no inline assembly."""
    for k0 in range(k_lo, k_end, BLOCK_K):
        lines = k0 + tl.arange(0, BLOCK_K // LINE) * LINE
        ptrs = tile_ptr + rows[:, None] * K + lines[None, :]
        prefetch_lines(tl.where(row_ok[:, None] & (lines < k_end)[None, :], ptrs, tile_ptr))


def _prefetch_lines(ptrs):
    """One fire-and-forget L2 prefetch request per pointer (a 128-byte line each). Compiled
    (PDL) only: the interpreter has no inline assembly."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )
