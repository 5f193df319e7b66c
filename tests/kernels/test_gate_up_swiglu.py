"""The fused gate/up projection + SwiGLU activation against its unfused launches.

Under the Triton interpreter (CPU) it is bit-identical to `small_gemm.gemm` followed by
`silu_mul`; on the GPU within an ulp of the output (the tensor cores' accumulation order).

    pytest tests/kernels/test_gate_up_swiglu.py -m gpu
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlt_engine.kernels.gate_up_swiglu import gate_up_silu
from rlt_engine.kernels.small_gemm import GemmConfig, gemm
from rlt_engine.kernels.small_gemm_tables import table_of
from rlt_engine.kernels.swiglu import silu_mul

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def make(m: int, n: int, k: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """x [m, k] and a packed [gate; up] weight [2n, k]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(2 * n, k, generator=gen) * 0.3).to(dtype)
    return x.to(device), w.to(device)


def unfused(x: torch.Tensor, w: torch.Tensor, config: GemmConfig) -> torch.Tensor:
    return silu_mul(gemm(x, w, config))


# (m, n, k, config): rows not a multiple of 16, n and k not multiples of their blocks
CASES = [
    (1, 64, 64, GemmConfig(block_n=64, block_k=32)),
    (5, 48, 80, GemmConfig(block_n=32, block_k=32)),
    (17, 96, 64, GemmConfig(block_n=64, block_k=16)),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("m", "n", "k", "config"), CASES)
def test_bit_identical_to_the_unfused_launches(m, n, k, config, dtype):
    x, w = make(m, n, k, dtype, seed=m)
    # the unfused GEMM's tile holds block_n packed rows; the fused one block_n / 2 of each half
    want = unfused(x, w, GemmConfig(config.block_n // 2, config.block_k, 1))
    got = gate_up_silu(x, w, config)
    assert got.shape == (m, n) and got.dtype == dtype
    assert torch.equal(got, want)


def test_views_and_lead_dims():
    x, w = make(6, 32, 64, torch.bfloat16, seed=3)
    config = GemmConfig(block_n=32, block_k=32)
    want = gate_up_silu(x, w, config)
    wide = torch.zeros(6, 100, dtype=torch.bfloat16)
    wide[:, 10:74] = x
    assert torch.equal(gate_up_silu(wide[:, 10:74], w, config), want)
    assert torch.equal(gate_up_silu(x.view(2, 3, 64), w, config), want.view(2, 3, 32))


def test_no_config_means_the_caller_runs_the_unfused_path():
    x, w = make(4, 32, 64, torch.float32)
    assert gate_up_silu(x, w) is None  # CPU tensors / no table entry: no fused kernel
    with pytest.raises(ValueError, match="2I, K"):
        gate_up_silu(x, w[:-1], GemmConfig(block_n=32, block_k=32))
    with pytest.raises(ValueError, match="multiple of 32"):
        gate_up_silu(x, w, GemmConfig(block_n=48, block_k=32))


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize(("n", "k"), [(5632, 2048), (10752, 3072)], ids=["ouro", "nanbeige"])
def test_gpu_model_shapes_within_an_ulp_of_the_unfused_path(m, n, k):
    x, w = make(m, n, k, torch.bfloat16, device="cuda", seed=m)
    row = table_of("NVIDIA H200")["entries"].get(f"{2 * n}x{k}:m{m}:bfloat16")
    config = GemmConfig(*row[1:6]) if row else GemmConfig(128, 128, 1, 4, 4)
    got = gate_up_silu(x, w, config)
    half = GemmConfig(config.block_n // 2, config.block_k, 1, config.num_warps, config.num_stages)
    want = unfused(x, w, half)
    diff = (got.float() - want.float()).abs()
    ulp = want.float().abs().clamp(min=2**-126) * 2**-7  # bf16 has 8 significant bits
    assert bool((diff <= ulp).all()), float((diff / ulp).max())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gate_up_silu(x, w, config)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gate_up_silu(x, w, config))
