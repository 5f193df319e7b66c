"""SwiGLU's activation in the small GEMM's prologue (small_gemm.gemm(..., silu_mul=True) and
linear_silu_mul) against its unfused form, swiglu.silu_mul then the same GEMM: bit-identical
(torch.equal) on the interpreter (small shapes) and on the GPU (Ouro / Nanbeige down shapes,
CUDA graphs).

GPU tests: pytest tests/kernels/test_small_gemm_silu.py -m gpu
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlt_engine.kernels.small_gemm import GemmConfig, gemm, linear, linear_silu_mul
from rlt_engine.kernels.swiglu import silu_mul

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def make(m: int, n: int, k: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(m, 2 * k, generator=gen) * 2).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.5).to(dtype)
    return gate_up.to(device), w.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (1, 48, 64, GemmConfig(block_n=16, block_k=32, split_k=1)),
        (5, 40, 100, GemmConfig(block_n=32, block_k=32, split_k=3)),  # ragged N and K
        (17, 32, 96, GemmConfig(block_n=16, block_k=32, split_k=2)),
    ],
)
def test_prologue_bit_identical_to_silu_mul_then_gemm(dtype, m, n, k, config):
    gate_up, w = make(m, n, k, dtype)
    fused = gemm(gate_up, w, config, silu_mul=True)
    assert torch.equal(fused, gemm(silu_mul(gate_up), w, config))


def test_linear_silu_mul_falls_back_on_the_cpu_and_checks_shapes():
    gate_up, w = make(3, 16, 32, torch.float32)
    assert torch.equal(linear_silu_mul(gate_up, w), linear(silu_mul(gate_up), w))
    with pytest.raises(ValueError, match=r"need x \[\.\.\., 64\]"):
        gemm(gate_up[:, :32], w, GemmConfig(16, 32, 1), silu_mul=True)


# -- GPU -----------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(2048, 5632), (3072, 10752)])
@pytest.mark.parametrize("m", [1, 8, 32, 64])
def test_gpu_down_shapes_bit_identical(shape, m):
    n, k = shape
    gate_up, w = make(m, n, k, torch.bfloat16, device="cuda", seed=m)
    act = silu_mul(gate_up)
    for config in (GemmConfig(64, 128, 4), GemmConfig(64, 256, 4), GemmConfig(64, 128, 1)):
        assert torch.equal(gemm(gate_up, w, config, silu_mul=True), gemm(act, w, config))
    assert torch.equal(linear_silu_mul(gate_up, w), linear(act, w))


@gpu
@needs_cuda
def test_gpu_cuda_graph():
    gate_up, w = make(8, 2048, 5632, torch.bfloat16, device="cuda", seed=3)
    static = gate_up.clone()
    config = GemmConfig(64, 128, 4)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        gemm(static, w, config, silu_mul=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm(static, w, config, silu_mul=True)
    for seed in (11, 12):
        new, _ = make(8, 2048, 5632, torch.bfloat16, device="cuda", seed=seed)
        static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gemm(silu_mul(new), w, config))
