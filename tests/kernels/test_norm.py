"""Fused Triton RMSNorm (+ residual) against the torch semantics of layers.RMSNorm.

Without CUDA the kernel runs under the Triton interpreter on small shapes (conftest.py here sets
TRITON_INTERPRET=1 before triton is imported). The only intended difference from torch is the
order of the fp32 sum of squares, so results are compared in ulps of the output dtype.

Measured (CPU interpreter, the cases below): fp32 max relative error 2.4e-7 (<= 2 fp32 ulps;
the per-row rsqrt factor differs by an ulp in some rows); bf16 and fp16: bit-identical in every
element measured. Asserted: fp32 within atol = rtol = 1e-6, bf16 / fp16 within 1 ulp.

GPU tests (Ouro / Nanbeige shapes, CUDA graphs): pytest tests/kernels/test_norm.py -m gpu -s
(-s prints the measured mismatch counts).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlt_engine.kernels.norm import rms_norm, rms_norm_reference, supported
from rlt_engine.models.layers import RMSNorm

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
DEVICE = "cpu"
EPS = 1e-6
FP32_TOL = 1e-6  # atol = rtol (values are O(1); residual sums cancel)
MAX_ULPS = 1  # bf16 / fp16


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place of a's dtype (exact, via the ordered bit patterns)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.float32:
        ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
        sign = 1 << 31
    else:
        ia, ib = a.view(torch.int16).long(), b.view(torch.int16).long()
        sign = 1 << 15
    # map sign-magnitude to a monotone integer line
    ia = torch.where(ia < 0, -(ia + sign), ia)
    ib = torch.where(ib < 0, -(ib + sign), ib)
    return (ia - ib).abs()


def make(rows: int, hidden: int, dtype: torch.dtype, device: str = DEVICE, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    norm = RMSNorm(hidden, EPS)
    norm.weight.data = torch.randn(hidden, generator=gen) * 0.5 + 1.0
    norm = norm.to(device=device, dtype=dtype)
    residual = (torch.randn(rows, hidden, generator=gen) * 2).to(dtype)
    return x.to(device), norm, residual.to(device)


def check(out: torch.Tensor, ref: torch.Tensor) -> tuple[int, int]:
    """Assert the declared bound; return (mismatching elements, max ulps)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=FP32_TOL, atol=FP32_TOL)
    d = ulps(out, ref)
    if out.dtype != torch.float32:
        assert d.max().item() <= MAX_ULPS, f"{d.max().item()} ulps"
    return int((d > 0).sum()), int(d.max())


def test_supported_cpu():
    ok, why = supported(torch.device("cpu"))
    assert ok, why


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [48, 96, 256])
def test_matches_rmsnorm(dtype, hidden):
    x, norm, residual = make(7, hidden, dtype)
    ref = norm(x)
    assert torch.equal(ref, rms_norm_reference(x, norm.weight, EPS))
    check(rms_norm(x, norm.weight, EPS), ref)
    check(rms_norm(x, norm.weight, EPS, residual=residual), residual + ref)


def test_bf16_bit_identical_measured():
    """What was measured on the interpreter: bf16 equals torch bit for bit here (the rsqrt
    factor differs by at most an fp32 ulp, which these inputs never carry into bf16)."""
    x, norm, residual = make(8, 96, torch.bfloat16, seed=3)
    torch.testing.assert_close(rms_norm(x, norm.weight, EPS), norm(x), atol=0, rtol=0)
    torch.testing.assert_close(
        rms_norm(x, norm.weight, EPS, residual=residual), residual + norm(x), atol=0, rtol=0
    )


def test_out_aliases_and_views():
    x, norm, residual = make(5, 48, torch.bfloat16)
    ref = residual + norm(x)
    # out = residual (the in-place residual update of a layer)
    res = residual.clone()
    got = rms_norm(x, norm.weight, EPS, residual=res, out=res)
    assert got is res
    check(res, ref)
    # out = x
    xc = x.clone()
    rms_norm(xc, norm.weight, EPS, out=xc)
    check(xc, norm(x))
    # rows with a stride (a slice of a wider buffer), 3-D input
    wide = torch.zeros(5, 80, dtype=torch.bfloat16)
    wide[:, 16:64] = x
    check(rms_norm(wide[:, 16:64], norm.weight, EPS), norm(x))
    x3 = x.view(5, 1, 48).expand(5, 2, 48)
    got3 = rms_norm(x3, norm.weight, EPS)
    assert got3.shape == (5, 2, 48)
    check(got3, norm(x3))


def test_batch_invariant():
    """A row's output is the same alone, in any batch, at any position (bit for bit)."""
    for dtype in (torch.float32, torch.bfloat16):
        x, norm, residual = make(9, 96, dtype, seed=1)
        batch = rms_norm(x, norm.weight, EPS, residual=residual)
        for i in (0, 4, 8):
            alone = rms_norm(x[i : i + 1], norm.weight, EPS, residual=residual[i : i + 1])
            assert torch.equal(alone[0], batch[i])
        perm = torch.tensor([8, 3, 0, 5, 1, 7, 2, 6, 4])
        shuffled = rms_norm(x[perm], norm.weight, EPS, residual=residual[perm])
        assert torch.equal(shuffled, batch[perm])


def test_weight_dtype_and_empty():
    x, norm, _ = make(3, 48, torch.bfloat16)
    w32 = norm.weight.float()
    # fp32 weight: read in fp32, result in x's dtype (same as bf16 weight when w is bf16-exact)
    assert torch.equal(rms_norm(x, w32, EPS), rms_norm(x, norm.weight, EPS))
    empty = rms_norm(x[:0], norm.weight, EPS)
    assert empty.shape == (0, 48)


def test_rejects_bad_arguments():
    x, norm, residual = make(3, 48, torch.float32)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, norm.weight[:32], EPS)
    with pytest.raises(ValueError, match="residual must be"):
        rms_norm(x, norm.weight, EPS, residual=residual[:2])
    with pytest.raises(ValueError, match="residual must be"):
        rms_norm(x, norm.weight, EPS, residual=residual.bfloat16())
    with pytest.raises(ValueError, match="out must be"):
        rms_norm(x, norm.weight, EPS, out=torch.empty(3, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        rms_norm(x, norm.weight, EPS, out=torch.empty(48, 3).t())


# -- GPU -----------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [2048, 3072])
@pytest.mark.parametrize("rows", [1, 8, 256])
def test_gpu_model_shapes(rows, hidden, dtype):
    x, norm, residual = make(rows, hidden, dtype, device="cuda", seed=rows)
    ref = norm(x)
    plain = check(rms_norm(x, norm.weight, EPS), ref)
    with_res = check(rms_norm(x, norm.weight, EPS, residual=residual), residual + ref)
    print(
        f"\nrms_norm {rows}x{hidden} {dtype}: mismatches/max ulps vs torch: plain {plain}, "
        f"residual {with_res} of {x.numel()}"
    )


@gpu
@needs_cuda
def test_gpu_batch_invariant():
    x, norm, residual = make(256, 2048, torch.bfloat16, device="cuda", seed=5)
    batch = rms_norm(x, norm.weight, EPS, residual=residual)
    for i in (0, 17, 255):
        alone = rms_norm(x[i : i + 1], norm.weight, EPS, residual=residual[i : i + 1])
        assert torch.equal(alone[0], batch[i])
    assert torch.equal(rms_norm(x[:8], norm.weight, EPS, residual=residual[:8]), batch[:8])


@gpu
@needs_cuda
def test_gpu_cuda_graph():
    x, norm, residual = make(8, 2048, torch.bfloat16, device="cuda", seed=7)
    static_x, static_res = x.clone(), residual.clone()
    out = torch.empty_like(x)
    out2 = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles outside the capture
        rms_norm(static_x, norm.weight, EPS, residual=static_res, out=out)
        rms_norm(static_x, norm.weight, EPS, out=out2)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rms_norm(static_x, norm.weight, EPS, residual=static_res, out=out)
        rms_norm(static_x, norm.weight, EPS, out=out2)
    for seed in (11, 12):
        nx, _, nres = make(8, 2048, torch.bfloat16, device="cuda", seed=seed)
        static_x.copy_(nx)
        static_res.copy_(nres)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, rms_norm(nx, norm.weight, EPS, residual=nres))
        assert torch.equal(out2, rms_norm(nx, norm.weight, EPS))
