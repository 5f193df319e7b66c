"""RoPE + K/V write in one launch (kernels/rope_kv_write.py) against its unfused form,
rope.apply_rope_ then kv_write.write_kv_: q, k (rotated in place), v and both pools must be
bit-identical (torch.equal) in every dtype, on the interpreter and on the GPU.

GPU tests (Ouro and GQA shapes, CUDA graphs): pytest tests/kernels/test_rope_kv_write.py -m gpu
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlt_engine.kernels.kv_write import write_kv_
from rlt_engine.kernels.rope import apply_rope_
from rlt_engine.kernels.rope_kv_write import _launch, rope_write_kv_
from rlt_engine.models.layers import RotaryEmbedding

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def case(rows, heads, kv_heads, head_dim, dtype, device="cpu", seed=0):
    """A packed qkv output [rows, heads + 2 kv_heads, D] (q, k, v are views), cos/sin of
    scattered positions, pools with random contents and a slot per row (the last rows share
    the trash slot, as idle decode rows do)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=gen) * 2).to(dtype)
    slots = 3 * rows + 2
    pool = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype)
    mapping = torch.randperm(slots - 1, generator=gen)[:rows]
    if rows > 2:
        mapping[-2:] = slots - 1  # trash slot
    positions = torch.randint(0, 40000, (rows,), generator=gen)
    cos, sin = RotaryEmbedding(head_dim, 1e6)(positions, dtype)
    tensors = [t.to(device) for t in (qkv, pool, mapping, cos, sin)]
    return tensors, (heads, kv_heads)


def both(tensors, split, **launch):
    """(fused state, unfused state): qkv after the launches, k pool and v pool."""
    qkv, pool, mapping, cos, sin = tensors
    heads, kv_heads = split
    states = []
    for fused in (True, False):
        buf, kp, vp = qkv.clone(), pool.clone(), pool.clone()
        q, k, v = buf.split([heads, kv_heads, kv_heads], dim=1)
        if fused:
            _launch(q, k, v, cos, sin, kp, vp, mapping, **launch)
        else:
            apply_rope_(q, k, cos, sin)
            write_kv_(kp, vp, k, v, mapping)
        states.append((buf, kp[:-1], vp[:-1]))  # the trash slot's contents are never read
    return states


def assert_same(states) -> None:
    for got, want in zip(*states, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (3, 3, 12), (2, 1, 128)])
def test_bit_identical_to_rope_then_write(dtype, heads, kv_heads, head_dim):
    tensors, split = case(5, heads, kv_heads, head_dim, dtype)
    assert_same(both(tensors, split))


@pytest.mark.parametrize("block_h", [1, 2, 4])
def test_head_tiles_straddling_q_k_and_v(block_h):
    tensors, split = case(3, 3, 2, 16, torch.bfloat16, seed=2)
    assert_same(both(tensors, split, block_h=block_h))


def test_empty_and_rejects_bad_arguments():
    (qkv, pool, mapping, cos, sin), _ = case(3, 2, 1, 8, torch.float32)
    q, k, v = qkv.split([2, 1, 1], dim=1)
    rope_write_kv_(q[:0], k[:0], v[:0], cos[:0], sin[:0], pool, pool.clone(), mapping[:0])
    with pytest.raises(ValueError, match="cos must be"):
        rope_write_kv_(q, k, v, cos.double(), sin, pool, pool.clone(), mapping)
    with pytest.raises(ValueError, match="must share one of"):
        rope_write_kv_(q, k, v, cos, sin, pool.bfloat16(), pool.bfloat16(), mapping)
    with pytest.raises(ValueError, match="k_pool and v_pool must be"):
        rope_write_kv_(q, k, v, cos, sin, pool[:, :, :4], pool[:, :, :4], mapping)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        rope_write_kv_(q, k, v, cos, sin, pool, pool.clone(), mapping[:2])


# -- GPU -----------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 8, 64, 300])
def test_gpu_ouro_shapes_bit_identical(rows, dtype):
    tensors, split = case(rows, 16, 16, 128, dtype, device="cuda", seed=rows)
    assert_same(both(tensors, split))


@gpu
@needs_cuda
def test_gpu_gqa_bit_identical():
    tensors, split = case(64, 24, 4, 128, torch.bfloat16, device="cuda", seed=9)
    assert_same(both(tensors, split))


@gpu
@needs_cuda
def test_gpu_cuda_graph():
    (qkv, pool, mapping, cos, sin), split = case(8, 16, 16, 128, torch.bfloat16, "cuda", seed=3)
    buf, kp, vp = qkv.clone(), pool.clone(), pool.clone()
    q, k, v = buf.split([16, 16, 16], dim=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles outside the capture
        rope_write_kv_(q, k, v, cos, sin, kp, vp, mapping)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope_write_kv_(q, k, v, cos, sin, kp, vp, mapping)
    for seed in (21, 22):
        new, _ = case(8, 16, 16, 128, torch.bfloat16, "cuda", seed=seed)
        buf.copy_(new[0])
        cos.copy_(new[3])
        sin.copy_(new[4])
        graph.replay()
        torch.cuda.synchronize()
        want = both([new[0], kp.clone(), mapping, new[3], new[4]], split)[1]
        got = (buf, kp[:-1], vp[:-1])
        # the graph rotated the fresh buffer once: compare with one unfused pass over it
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1][mapping[:-2]], want[1][mapping[:-2]])
        assert torch.equal(got[2][mapping[:-2]], want[2][mapping[:-2]])
