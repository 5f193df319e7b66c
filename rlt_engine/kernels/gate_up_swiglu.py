"""The packed gate/up projection and SwiGLU's activation in one Triton launch, for decode rows:
`gate_up_silu(x, w) == silu_mul(x @ w.T)` with w = [gate; up] packed [2I, K].

A program owns output columns [n0, n0 + BLOCK_N) of the activation: it streams the matching
gate rows (n0..) and up rows (I + n0..) of the packed weight with two swap-AB dots per K step
(the small-M GEMM's layout, kernels/small_gemm.py), then applies the activation in registers.
So the [M, 2I] projection never goes to memory and the separate activation launch is gone
(2-3 us per layer at decode). The roundings are the unfused path's: each accumulator is rounded
to the dtype as the GEMM would store it, then silu and the product as kernels/swiglu computes
them. Under the interpreter the result is bit-identical to `small_gemm.gemm` + `silu_mul`; on
the GPU to within the tensor cores' accumulation order (tested to an ulp of the output).

Used where the small-GEMM table has a config for the packed shape with no split-K (its
BLOCK_N rows become two halves of BLOCK_N / 2); a config of the warp-specialised kernel runs
its SwiGLU form (kernels/ws_gemm.py, the same roundings); elsewhere `gate_up_silu` returns
None and the caller runs the two launches. CUDA-graph capturable; triton imported lazily.
"""

from __future__ import annotations

import torch

from rlt_engine.kernels import paged_attention as _pa
from rlt_engine.kernels import pdl as _pdl
from rlt_engine.kernels import small_gemm as _gemm
from rlt_engine.kernels import swiglu as _swiglu

__all__ = ["gate_up_silu"]

# set by _import_triton(); read by the kernel
triton = tl = libdevice = round_bf16 = prefetch_l2 = None


def gate_up_silu(
    x: torch.Tensor, w: torch.Tensor, config: _gemm.GemmConfig | None = None
) -> torch.Tensor | None:
    """silu(x @ gate.T) * (x @ up.T) for w = [gate; up] [2I, K]; None where the fused kernel
    has no config (the caller then runs the GEMM and `silu_mul`). `config` (tests, the
    benchmark) forces one: its block_n is split into the gate and up halves."""
    if config is None:
        config = _gemm.choose(x, w, gated=True)
        if config is None or config.split_k != 1:
            return None
    if config.kernel == "ws":  # the warp-specialised kernel's SwiGLU form (kernels/ws_gemm)
        from rlt_engine.kernels import ws_gemm

        if not ws_gemm.available(x.device) or ws_gemm.refusal(x, w, config, swiglu=True):
            return None
        return ws_gemm.ws_gemm(x, w, config, swiglu=True)
    if w.dim() != 2 or w.shape[0] % 2 or x.shape[-1] != w.shape[1] or not w.is_contiguous():
        raise ValueError(f"need x [..., K] and w [2I, K] contiguous, got {x.shape}, {w.shape}")
    if x.dtype != w.dtype or x.device != w.device or config.block_n % 32:
        raise ValueError("x and w must share dtype and device; block_n a multiple of 32")
    n, k = w.shape[0] // 2, w.shape[1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > _gemm.MAX_M:
        raise ValueError(f"at most {_gemm.MAX_M} rows, got {m}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    interpret = _gemm._ready(x.device)
    _import_triton()
    half = config.block_n // 2
    pdl = _pdl.enabled(x.device)
    prefetch_k = _pdl.prefetch_k(2 * n, 1, k, config.block_k, x.element_size()) if pdl else 0
    kernel = _pa._kernel(_gate_up_silu_kernel, interpret)
    with _pa._on_device(x.device):
        kernel[(triton.cdiv(n, half),)](
            x2,
            w,
            out,
            m,
            n,
            k,
            x2.stride(0),
            prefetch_k,
            BLOCK_M=max(16, triton.next_power_of_2(m)),
            BLOCK_N=half,
            BLOCK_K=config.block_k,
            EVEN=n % half == 0 and k % config.block_k == 0,
            EXACT=not interpret,
            UPCAST=interpret and x.dtype != torch.float32,
            ROUND_BF16=interpret and x.dtype == torch.bfloat16,
            PDL=pdl,
            LINE=_pdl.LINE_BYTES // x.element_size(),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **_pdl.launch_options(pdl),
        )
    return out.view(*lead, n)


def _import_triton() -> None:
    global triton, tl, libdevice, round_bf16, prefetch_l2
    _swiglu._import_triton()
    _pdl._import_triton()
    triton, tl, libdevice, round_bf16 = _pa.triton, _pa.tl, _swiglu.libdevice, _swiglu.round_bf16
    prefetch_l2 = _pdl.prefetch_l2


def _gate_up_silu_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,  # I: columns of the activation (the packed weight has 2N rows)
    K,
    stride_xm,
    prefetch_k,  # PDL: columns of its gate and up rows each program prefetches before the wait
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # gate rows (and as many up rows) per program
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks on the weights
    EXACT: tl.constexpr,  # libdevice expf + IEEE division, as torch's CUDA silu
    UPCAST: tl.constexpr,  # interpreter: its bf16 dot is wrong; fp32 products are exact
    ROUND_BF16: tl.constexpr,  # interpreter: its fp32->bf16 conversion truncates
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
    LINE: tl.constexpr,  # elements per 128-byte line (PDL's prefetch)
):
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_M)
    n0 = tl.program_id(0) * BLOCK_N
    n_ok = (n0 + rows) < N
    m_ok = cols < M
    gate_tile = w_ptr + n0.to(tl.int64) * K
    up_tile = w_ptr + (N + n0).to(tl.int64) * K
    if PDL:  # the weights depend on no kernel: start their stream, then wait (kernels/pdl.py)
        k_end = tl.minimum(prefetch_k, K)
        prefetch_l2(gate_tile, rows, n_ok, K, 0, k_end, BLOCK_K, LINE)
        prefetch_l2(up_tile, rows, n_ok, K, 0, k_end, BLOCK_K, LINE)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        offs = rows[:, None] * K + ks[None, :]
        x_ptrs = x_ptr + cols[None, :] * stride_xm + ks[:, None]
        if EVEN:
            xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            wg = tl.load(gate_tile + offs)
            wu = tl.load(up_tile + offs)
        else:
            k_ok = ks < K
            xt = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            w_ok = n_ok[:, None] & k_ok[None, :]
            wg = tl.load(gate_tile + offs, mask=w_ok, other=0.0)
            wu = tl.load(up_tile + offs, mask=w_ok, other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            acc_g = tl.dot(wg.to(tl.float32), xt, acc_g, input_precision="ieee")
            acc_u = tl.dot(wu.to(tl.float32), xt, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(wg, xt, acc_g, input_precision="ieee")
            acc_u = tl.dot(wu, xt, acc_u, input_precision="ieee")

    dtype = out_ptr.dtype.element_ty
    # the GEMM's stores: each projection rounded to the dtype
    if ROUND_BF16:
        g, u = round_bf16(acc_g), round_bf16(acc_u)
    else:
        g, u = acc_g.to(dtype).to(tl.float32), acc_u.to(dtype).to(tl.float32)
    # kernels/swiglu: silu in fp32, rounded, times up in fp32, rounded
    if EXACT:  # noqa: SIM108 - a constexpr branch: only the taken one is compiled
        silu = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
    else:
        silu = g / (1.0 + tl.exp(-g))
    if ROUND_BF16:
        act = round_bf16(round_bf16(silu) * u).to(dtype)
    else:
        act = (silu.to(dtype).to(tl.float32) * u).to(dtype)
    out_ptrs = out_ptr + cols[None, :] * N + (n0 + rows)[:, None]
    tl.store(out_ptrs, act, mask=m_ok[None, :] & n_ok[:, None])
