"""The packed q/k/v projection + RoPE + K/V write in one launch (kernels/qkv_rope.py) against
the two launches it replaces: the small GEMM then rope_kv_write.rope_write_kv_.

Bit for bit against the GEMM with a BLOCK_J-row tile (the same dots: a matmul's fp32 sums
depend on its tile shape, on the CPU's BLAS as on the tensor cores): on CPU under the
interpreter (conftest sets TRITON_INTERPRET=1) at small shapes, on the GPU at Ouro-1.4B and
Nanbeige shapes, eagerly and replayed from a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from rlt_engine.kernels.qkv_rope import qkv_rope_write
from rlt_engine.kernels.rope_kv_write import rope_write_kv_
from rlt_engine.kernels.small_gemm import GemmConfig, gemm

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


class Case:
    def __init__(self, m, heads, kv, d, k, dtype, device, slots=40, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv, self.d = heads, kv, d
        n = (heads + 2 * kv) * d
        self.x = torch.randn(m, k, generator=gen).to(device, dtype)
        self.w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device, dtype)
        angles = torch.randn(m, d // 2, generator=gen).repeat(1, 2)
        self.cos, self.sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
        self.k_pool = torch.randn(slots, kv, d, generator=gen).to(device, dtype)
        self.v_pool = torch.randn(slots, kv, d, generator=gen).to(device, dtype)
        self.slots = torch.randperm(slots, generator=gen)[:m].to(device)

    def two_launches(self, config: GemmConfig):
        k_pool, v_pool = self.k_pool.clone(), self.v_pool.clone()
        qkv = gemm(self.x, self.w, config)
        view = qkv.view(qkv.shape[0], -1, self.d)
        q, k, v = view.split([self.heads, self.kv, self.kv], dim=1)
        rope_write_kv_(q, k, v, self.cos, self.sin, k_pool, v_pool, self.slots)
        return qkv, k_pool, v_pool

    def fused(self, config: GemmConfig):
        k_pool, v_pool = self.k_pool.clone(), self.v_pool.clone()
        qkv = qkv_rope_write(
            self.x, self.w, self.cos, self.sin, k_pool, v_pool, self.slots, self.heads, self.kv,
            config,
        )  # fmt: skip
        return qkv, k_pool, v_pool


def same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "heads", "kv", "d", "k", "config"),
    [
        (1, 2, 2, 32, 64, GemmConfig(block_n=32, block_k=32)),  # MHA, one pair tile per head
        (5, 4, 2, 32, 96, GemmConfig(block_n=32, block_k=64)),  # GQA, K not a block multiple
        (3, 2, 1, 64, 64, GemmConfig(block_n=32, block_k=32)),  # two pair tiles per head
    ],
)
def test_equals_the_two_launches(m, heads, kv, d, k, config, dtype):
    case = Case(m, heads, kv, d, k, dtype, "cpu", seed=m)
    tile = dataclasses.replace(config, block_n=config.block_n // 2)  # the same dots
    same(case.fused(config), case.two_launches(tile))


def test_a_partial_pair_tile_is_masked():
    """D / 2 = 24 with 16 pairs a tile: the second tile's last 8 rows are masked. (A matmul's
    sums depend on where a row sits in its tile, so the reference is close, not equal.)"""
    case = Case(3, 2, 1, 48, 64, torch.float32, "cpu", seed=3)
    config = GemmConfig(block_n=32, block_k=32)
    for got, want in zip(case.fused(config), case.two_launches(config), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_refuses_what_it_cannot_do():
    case = Case(2, 2, 2, 32, 64, torch.float32, "cpu")
    config = GemmConfig(block_n=32, block_k=32)
    with pytest.raises(ValueError, match="heads"):
        qkv_rope_write(case.x, case.w[:-1], case.cos, case.sin, case.k_pool, case.v_pool,
                       case.slots, 2, 2, config)  # fmt: skip
    with pytest.raises(ValueError, match="cos / sin"):
        qkv_rope_write(case.x, case.w, case.cos[:1], case.sin, case.k_pool, case.v_pool,
                       case.slots, 2, 2, config)  # fmt: skip
    # CPU tensors have no table entry: the caller runs the two launches
    assert qkv_rope_write(case.x, case.w, case.cos, case.sin, case.k_pool, case.v_pool,
                          case.slots, 2, 2) is None  # fmt: skip


@gpu
@needs_cuda
@pytest.mark.parametrize(("heads", "kv", "d", "k"), [(16, 16, 128, 2048), (24, 4, 128, 3072)])
def test_gpu_model_shapes_equal_the_two_launches(heads, kv, d, k):
    config = GemmConfig(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3)
    tile = dataclasses.replace(config, block_n=config.block_n // 2)  # the same dots
    for m in (1, 8, 16):
        case = Case(m, heads, kv, d, k, torch.bfloat16, "cuda", slots=64, seed=m)
        want = case.two_launches(tile)
        for _ in range(3):
            same(case.fused(config), want)
        k_pool, v_pool = case.k_pool.clone(), case.v_pool.clone()
        qkv_rope_write(case.x, case.w, case.cos, case.sin, k_pool, v_pool, case.slots,
                       heads, kv, config)  # fmt: skip
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            qkv = qkv_rope_write(case.x, case.w, case.cos, case.sin, k_pool, v_pool,
                                 case.slots, heads, kv, config)  # fmt: skip
        k_pool.copy_(case.k_pool)
        v_pool.copy_(case.v_pool)
        graph.replay()
        torch.cuda.synchronize()
        same((qkv, k_pool, v_pool), want)
