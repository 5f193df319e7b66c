"""Triton K/V row writes (kernels/kv_write.py) against torch's index assignment: exact."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlt_engine.kernels.kv_write import write_kv_

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _case(rows: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str = "cpu"):
    gen = torch.Generator().manual_seed(rows + kv_heads)
    slots = 4 * rows + 1
    heads = 2 * kv_heads  # a packed qkv output: q heads, then k, then v
    qkv = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype).to(device)
    k, v = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    mapping = torch.randperm(slots - 1, generator=gen)[:rows].to(device)
    pool = torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device)
    return pool, k, v, mapping


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "kv_heads", "head_dim"), [(1, 1, 8), (7, 2, 16), (4, 3, 12)])
def test_views_of_packed_qkv_exact(dtype, rows, kv_heads, head_dim) -> None:
    pool, k, v, mapping = _case(rows, kv_heads, head_dim, dtype)
    assert rows == 1 or not k.is_contiguous()
    kp, vp = pool.clone(), pool.clone()
    write_kv_(kp, vp, k, v, mapping)
    want_k, want_v = pool.clone(), pool.clone()
    want_k[mapping], want_v[mapping] = k, v
    assert torch.equal(kp, want_k) and torch.equal(vp, want_v)


def test_non_contiguous_heads_are_copied_first() -> None:
    pool, k, v, mapping = _case(3, 2, 8, torch.float32)
    k_t = k.transpose(1, 2).contiguous().transpose(1, 2)  # heads not adjacent in memory
    kp, vp = pool.clone(), pool.clone()
    write_kv_(kp, vp, k_t, v, mapping)
    assert torch.equal(kp[mapping], k) and torch.equal(vp[mapping], v)


def test_bad_shapes() -> None:
    pool, k, v, mapping = _case(3, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        write_kv_(pool, pool.clone(), k, v, mapping[:2])
    with pytest.raises(ValueError, match="dtype"):
        write_kv_(pool, pool.clone(), k.double(), v, mapping)


@gpu
@needs_cuda
def test_gpu_exact_and_capturable() -> None:
    pool, k, v, mapping = _case(64, 16, 128, torch.bfloat16, "cuda")
    kp, vp = pool.clone(), pool.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_kv_(kp, vp, k, v, mapping)
    graph.replay()
    assert torch.equal(kp[mapping], k) and torch.equal(vp[mapping], v)
