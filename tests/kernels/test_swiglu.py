"""Triton silu(gate) * up (kernels/swiglu.py) against torch's two kernels.

On the CPU (interpreter) exp is numpy's and torch's CPU silu uses its own, so results agree to
one rounding of the output dtype; on the GPU the kernel repeats torch's CUDA arithmetic and the
results are bit-identical (`-m gpu`).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlt_engine.kernels.swiglu import BLOCK, silu_mul, silu_mul_reference
from rlt_engine.models.layers import SwiGLU

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _input(rows: int, width: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    return (torch.randn(rows, 2 * width, generator=gen) * 3).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "width"), [(1, 8), (5, 37), (3, BLOCK + 5)])
def test_matches_torch(dtype, rows, width) -> None:
    x = _input(rows, width, dtype)
    got, want = silu_mul(x), silu_mul_reference(x)
    assert got.shape == (rows, width) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_strided_rows_and_empty() -> None:
    x = _input(6, 16, torch.float32)[::2]  # row stride 64, still contiguous within a row
    torch.testing.assert_close(silu_mul(x), silu_mul_reference(x), rtol=2e-6, atol=2e-6)
    assert silu_mul(torch.empty(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="2 \\* I"):
        silu_mul(torch.zeros(2, 5))


def test_fused_swiglu_module_matches_unfused() -> None:
    torch.manual_seed(0)
    mlp = SwiGLU(16, 24)
    x = torch.randn(4, 16)
    want = mlp(x)
    mlp.pack()
    mlp.fused_act = True
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-6)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 8, 64, 512])
def test_gpu_bit_identical_to_torch(dtype, rows) -> None:
    x = _input(rows, 5632, dtype, "cuda")  # Ouro-1.4B's intermediate size
    torch.testing.assert_close(silu_mul(x), silu_mul_reference(x), rtol=0, atol=0)


@gpu
@needs_cuda
def test_gpu_graph_capture() -> None:
    x = _input(8, 5632, torch.bfloat16, "cuda")
    eager = silu_mul(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_mul(x)
    graph.replay()
    assert torch.equal(out, eager)
