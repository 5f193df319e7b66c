"""A residual add and the next RMSNorm in one Triton launch: the chain between two sublayers.

`add_rms_norm(y, residual, weight, eps, y_weight=..., y_eps=...)` returns (x, h) with

    x = residual + rms_norm(y, y_weight, y_eps)      (Ouro's sandwich norm: with y_weight)
    x = residual + y                                 (pre-norm models: without y_weight)
    h = rms_norm(x, weight, eps)

which the layers otherwise compute with two launches of kernels/norm.rms_norm (or a torch add
and one rms_norm). One program per row reads the row once and writes both results; each norm
is norm.py's own row code (`_normed_row`) with the same block and warps, so the fp32 sums use
the same reduction tree and x and h equal the two-launch results bit for bit in every dtype
(the add `residual + y` is torch's: fp32 sum rounded once to the dtype). `h` is computed from x
as rounded to the dtype, exactly what the second launch would read.

`add_rms_norm_hazard` also returns Ouro's exit hazard of h, sigmoid(h . w + b) in fp32 (the
learned gate after the last layer's final norm), from the row the program already holds, where
the model otherwise runs four more launches (a cast, cuBLAS's gemv and its reduction, the
sigmoid) outside the PDL chain. Its dot sums in the norm's reduction tree instead of cuBLAS's
order, so it agrees with `torch.sigmoid(F.linear(h.float(), w, b))` to a few fp32 ulps, not
bit for bit; sigmoid itself is torch's CUDA formula (libdevice expf, an IEEE division).

y may also be a split-K GEMM's unsummed partials (kernels/split_sums.SplitSums, from ws_gemm's
`unreduced`): the program then sums its row's partials in split order from 0.0 in fp32 and
rounds once, as the GEMM would have, so x, h and the hazard are the same bits as from the
summed y, and the GEMM's tail loses its ticket and reload.

Rows are independent (batch invariant). CUDA-graph capturable: no host synchronisation, the
grid depends only on the shapes. triton is imported lazily (see paged_attention).
"""

from __future__ import annotations

import torch

from rlt_engine.kernels import norm as _norm
from rlt_engine.kernels import paged_attention as _pa
from rlt_engine.kernels import pdl as _pdl
from rlt_engine.kernels.norm import rms_norm_reference, supported
from rlt_engine.kernels.split_sums import SplitSums

__all__ = ["add_rms_norm", "add_rms_norm_hazard", "add_rms_norm_reference", "supported"]

# set by _import_triton(); the kernel's body reads `tl`, `libdevice`, `round_bf16`, `normed_row`,
# `prefetch_lines`, `clocks`, `clock_after`
triton = tl = libdevice = round_bf16 = normed_row = prefetch_lines = clocks = clock_after = None

PROBE_FIELDS = (  # what a PROBE build stamps per program (%globaltimer ns), in this order
    "start",  # the program begins (before the PDL wait)
    "waited",  # its PDL wait returned
    "loaded",  # x computed: its row's y (or partials) and residual landed (and y normed)
    "end",  # x and h stored
)
# Per hidden size, up to how many rows the add + norm releases the next kernel before its wait
# (kernels/pdl.py): the GEMM after it then starts its weight stream as the GEMM before leaves
# the SMs, not once the add + norm's wait has returned. The add + norm's own loads then land
# behind that stream (at 1 row 1.3 -> 5.1 us after its wait). Measured in decode on an H100
# (benchmarks/results/2026-12-07-norm-release-early-h100.md): Ouro-1.4B's 2048 c=1 / 2 / 4 /
# 8 / 16 +1.7% / +1.6% / +2.1% / +1.6% / +2.4%, c=32 -0.6%, c=64 even; Nanbeige4.2-3B's 3072
# c=1 / 8 -0.3% / -1.3%, so not there. An A/B switch (ab_decode --set ...={})
RELEASE_EARLY_ROWS: dict[int, int] = {2048: 16}


def add_rms_norm_reference(
    y: torch.Tensor | SplitSums,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    y_weight: torch.Tensor | None = None,
    y_eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch semantics: (x, rms_norm(x)) with x = residual + (norm(y) or y)."""
    if isinstance(y, SplitSums):
        y = y.total()
    if y_weight is None:
        x = residual + y
    else:
        x = rms_norm_reference(y, y_weight, y_eps if y_eps is not None else eps, residual)
    return x, rms_norm_reference(x, weight, eps)


def add_rms_norm(
    y: torch.Tensor | SplitSums,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    y_weight: torch.Tensor | None = None,
    y_eps: float | None = None,
    *,
    probe: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y, residual: [rows, H] of one float dtype (last dimension contiguous; y may be a
    SplitSums of that shape and dtype, summed here); weight and
    y_weight: [H] (any float dtype, read in fp32). Returns new tensors (x, h), both [rows, H] in
    y's dtype: x = residual + norm(y; y_weight, y_eps) (or residual + y without y_weight) and
    h = norm(x; weight, eps). `probe` (benchmarks/bench_kernel_clock.py; CUDA under PDL only):
    int64 [rows, len(PROBE_FIELDS)] receiving each program's stamps."""
    return _launch(y, residual, weight, eps, y_weight, y_eps, probe=probe)[:2]


def add_rms_norm_hazard(
    y: torch.Tensor | SplitSums,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    y_weight: torch.Tensor | None = None,
    y_eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_rms_norm`'s (x, h) and hazard = sigmoid(h . gate_weight + gate_bias) fp32 [rows]:
    gate_weight fp32 [H] (or [1, H]), gate_bias fp32 [1] (an nn.Linear(H, 1)'s, converted)."""
    hidden = y.shape[-1]
    if gate_weight.numel() != hidden or gate_bias.numel() != 1:
        raise ValueError(
            f"the gate must be [{hidden}] weights and one bias, got "
            f"{tuple(gate_weight.shape)} and {tuple(gate_bias.shape)}"
        )
    for name, t in (("gate_weight", gate_weight), ("gate_bias", gate_bias)):
        if t.dtype != torch.float32 or t.device != y.device:
            raise ValueError(f"{name} must be fp32 on {y.device}, got {t.dtype} on {t.device}")
    return _launch(y, residual, weight, eps, y_weight, y_eps, (gate_weight, gate_bias))


def _launch(y, residual, weight, eps, y_weight, y_eps, gate=None, probe=None):
    """(x, h, hazard or None); `gate`: (weight, bias) fp32."""
    parts = None
    if isinstance(y, SplitSums):
        parts = y.parts
        if parts.dim() != 3 or parts.dtype != torch.float32 or y.dtype not in _norm._DTYPES:
            raise ValueError(
                f"split sums must be fp32 [splits, rows, H] of a {_norm._DTYPES} output, got "
                f"{parts.dtype} {tuple(parts.shape)} of {y.dtype}"
            )
        parts = parts.contiguous()
    if len(y.shape) != 2 or y.dtype not in _norm._DTYPES:
        raise ValueError(f"y must be [rows, H] of {_norm._DTYPES}, got {y.dtype} {tuple(y.shape)}")
    if residual.shape != y.shape or residual.dtype != y.dtype or residual.device != y.device:
        raise ValueError(
            f"residual must be {tuple(y.shape)} {y.dtype} on {y.device}, got "
            f"{tuple(residual.shape)} {residual.dtype} on {residual.device}"
        )
    rows, hidden = y.shape
    if not 1 <= hidden <= _norm.MAX_HIDDEN:
        raise ValueError(f"H must be in [1, {_norm.MAX_HIDDEN}], got {hidden}")
    weights = [weight] if y_weight is None else [weight, y_weight]
    for w in weights:
        if w.shape != (hidden,) or w.dtype not in _norm._DTYPES or w.device != y.device:
            raise ValueError(
                f"weights must be [{hidden}] float on {y.device}, got {tuple(w.shape)} "
                f"{w.dtype} on {w.device}"
            )
    if parts is None:
        y = y if y.stride(-1) == 1 else y.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    weight = weight.contiguous()
    y_weight = weight if y_weight is None else y_weight.contiguous()
    x = torch.empty(rows, hidden, dtype=y.dtype, device=y.device)
    h = torch.empty_like(x)
    hazard = None if gate is None else torch.empty(rows, dtype=torch.float32, device=y.device)
    if rows == 0:
        return x, h, hazard
    gate_w, gate_b = (weight, weight) if gate is None else (gate[0].contiguous(), gate[1])
    ok, why = supported(y.device)
    if not ok:
        raise RuntimeError(f"Triton add_rms_norm cannot run on {y.device}: {why}")
    _import_triton()
    interpret = _pa._interpreter_mode()
    block = triton.next_power_of_2(hidden)
    kernel = _pa._kernel(_add_rms_norm_kernel, interpret)
    pdl = _pdl.enabled(y.device)
    if probe is not None and (
        not pdl or probe.shape != (rows, len(PROBE_FIELDS)) or probe.dtype != torch.int64
    ):
        raise ValueError(f"probe must be int64 [{rows}, {len(PROBE_FIELDS)}] on a PDL device")
    with _pa._on_device(y.device):
        kernel[(rows,)](
            y if parts is None else parts,
            residual,
            y_weight,
            weight,
            x,
            h,
            gate_w,
            gate_b,
            h if hazard is None else hazard,
            h if probe is None else probe,
            y.stride(0) if parts is None else hidden,
            residual.stride(0),
            rows * hidden,
            float(eps if y_eps is None else y_eps),
            float(eps),
            H=hidden,
            BLOCK=block,
            INV_H=1.0 / hidden,
            SPLITS=0 if parts is None else parts.shape[0],
            NORM_Y=len(weights) == 2,
            GATE=gate is not None,
            EXACT_MUL=not interpret,
            ROUND_BF16=interpret and y.dtype == torch.bfloat16,
            PDL=pdl,
            EARLY=rows <= RELEASE_EARLY_ROWS.get(hidden, 0),
            PROBE=probe is not None,
            LINE=_pdl.LINE_BYTES // x.element_size(),
            LINES=max(1, block * x.element_size() // _pdl.LINE_BYTES),
            num_warps=_norm.num_warps_for(block),  # norm.py's: the same reduction tree
            **_pdl.launch_options(pdl),
        )
    return x, h, hazard


def _import_triton() -> None:
    global triton, tl, libdevice, round_bf16, normed_row, prefetch_lines, clocks, clock_after
    from rlt_engine.kernels import swiglu as _swiglu

    _norm._import_triton()
    _swiglu._import_triton()
    _pdl._import_triton()
    triton, tl, libdevice = _norm.triton, _norm.tl, _swiglu.libdevice
    round_bf16, normed_row, prefetch_lines = _norm.round_bf16, _norm.normed_row, _pdl.prefetch_lines
    clocks, clock_after = _pdl.clocks, _pdl.clock_after


# ----------------------------------------------------------------------------------------------
# Kernel (a plain function; see paged_attention._kernel). Annotations are strings (future
# import), which triton reads as constexpr markers, so defining it needs no triton.


def _add_rms_norm_kernel(
    y_ptr,  # y [rows, H] (last dimension contiguous), or SPLITS fp32 partials [SPLITS, rows, H]
    res_ptr,
    wy_ptr,
    w_ptr,
    x_ptr,  # out: residual + norm(y) (or + y), [rows, H] contiguous
    h_ptr,  # out: norm(x), [rows, H] contiguous
    gw_ptr,  # GATE: the exit gate's fp32 weights [H]
    gb_ptr,  # GATE: its fp32 bias [1]
    hazard_ptr,  # GATE: out, fp32 [rows]
    probe_ptr,  # PROBE: int64 [rows, len(PROBE_FIELDS)]
    stride_y,
    stride_r,
    stride_split,  # SPLITS: one split's partials, rows * H
    eps_y,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two of H
    INV_H: tl.constexpr,  # fp32(1 / H)
    SPLITS: tl.constexpr,  # y is that many partials to sum (kernels/split_sums), or 0
    NORM_Y: tl.constexpr,  # x = residual + norm(y) (else residual + y)
    GATE: tl.constexpr,  # also the exit hazard sigmoid(h . gw + gb)
    EXACT_MUL: tl.constexpr,  # mul.rn (no FMA contraction); False in the interpreter
    ROUND_BF16: tl.constexpr,  # round to bf16 by hand (interpreter: its fp32->bf16 truncates)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
    EARLY: tl.constexpr,  # PDL: the next kernel released before the wait (RELEASE_EARLY_ROWS)
    PROBE: tl.constexpr,  # benchmarks: timer stamps per program (PROBE_FIELDS)
    LINE: tl.constexpr,  # PDL: elements per 128-byte line (the residual's L2 prefetch)
    LINES: tl.constexpr,  # PDL: lines a row spans, a power of two (max(1, BLOCK // LINE))
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    if PROBE:
        ns0, _ = clocks()
    # the norms' weights (parameters: no kernel writes them) before the wait: a decode layer's
    # weight stream has evicted them from L2, and the second norm would otherwise wait for
    # its weights' round trip only after the first norm's reduction (kernels/pdl.py)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM_Y:
        wy = tl.load(wy_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GATE:
        gw = tl.load(gw_ptr + cols, mask=mask, other=0.0)
        gb = tl.load(gb_ptr)
    if PDL:  # ask L2 for the residual row, wait for the previous kernel, release the next
        lines = tl.arange(0, LINES) * LINE
        at = res_ptr + row * stride_r
        prefetch_lines(tl.where(lines < H, at + lines, at))
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if not EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    if PROBE:
        ns1, _ = clocks()
    if SPLITS:  # the GEMM's sum: 0.0 + p0 + p1 + ... in fp32, rounded once
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            at = y_ptr + s * stride_split + row * stride_y + cols
            total += tl.load(at, mask=mask, other=0.0)
        if ROUND_BF16:
            total = round_bf16(total)
        y = total.to(x_ptr.dtype.element_ty)
    else:
        y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0)
    r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
    if NORM_Y:
        o = r.to(tl.float32) + normed_row(y, wy, eps_y, INV_H, EXACT_MUL, ROUND_BF16)
    else:
        o = r.to(tl.float32) + y.to(tl.float32)
    if ROUND_BF16:
        o = round_bf16(o)
    if PROBE:  # (a reduction that waits for the loads: PROBE builds only)
        ns2 = clock_after(tl.sum(o, axis=0).to(tl.int32, bitcast=True))
    x = o.to(y.dtype)  # exact for the interpreter's truncating cast once rounded
    tl.store(x_ptr + row * H + cols, x, mask=mask)
    h = normed_row(x, w, eps, INV_H, EXACT_MUL, ROUND_BF16)
    tl.store(h_ptr + row * H + cols, h.to(y.dtype), mask=mask)
    if GATE:  # the gate reads h as stored (exact for the interpreter once rounded)
        logit = tl.sum(h.to(y.dtype).to(tl.float32) * gw, axis=0) + gb
        if EXACT_MUL:  # torch's CUDA sigmoid: libdevice expf, an IEEE division
            hazard = tl.math.div_rn(1.0, 1.0 + libdevice.exp(-logit))
        else:  # the interpreter has no libdevice
            hazard = 1.0 / (1.0 + tl.exp(-logit))
        tl.store(hazard_ptr + row, hazard)
    if PROBE:
        ns3, _ = clocks()
        at = probe_ptr + row * 4  # PROBE_FIELDS' order
        tl.store(at + 0, ns0)
        tl.store(at + 1, ns1)
        tl.store(at + 2, ns2)
        tl.store(at + 3, ns3)
