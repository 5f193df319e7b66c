"""In-place Triton RoPE on q and k against layers.apply_rope (bit for bit).

Without CUDA the kernel runs under the Triton interpreter on small shapes (conftest.py here sets
TRITON_INTERPRET=1 before triton is imported). The kernel performs torch's roundings (each
product rounded to the dtype, then the sum), so every comparison is exact (atol = rtol = 0):
measured bit-identical for fp32, bf16 and fp16 on the interpreter.

GPU tests (Ouro shapes, CUDA graphs): pytest tests/kernels/test_rope.py -m gpu
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlt_engine.kernels.rope import _launch, apply_rope_, apply_rope_reference, supported
from rlt_engine.models.layers import RotaryEmbedding, apply_rope

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def exact(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def packed(rows, heads, kv_heads, head_dim, dtype, device="cpu", seed=0, theta=10000.0):
    """A packed qkv projection output [rows, (heads + 2 kv_heads) * D] with q and k as views,
    cos/sin of scattered positions."""
    gen = torch.Generator().manual_seed(seed)
    buf = (torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2).to(dtype)
    buf = buf.to(device)
    q = buf[:, : heads * head_dim].view(rows, heads, head_dim)
    k = buf[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    positions = torch.randint(0, 40000, (rows,), generator=gen).to(device)
    rope = RotaryEmbedding(head_dim, theta).to(device)
    cos, sin = rope(positions, dtype)
    return buf, q, k, cos, sin


def test_supported_cpu():
    ok, why = supported(torch.device("cpu"))
    assert ok, why


def test_reference_is_layers_apply_rope():
    _, q, _, cos, sin = packed(3, 2, 1, 16, torch.bfloat16)
    assert torch.equal(apply_rope_reference(q, cos, sin), apply_rope(q, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (3, 3, 12), (2, 1, 128)])
def test_packed_views_bit_identical(dtype, heads, kv_heads, head_dim):
    buf, q, k, cos, sin = packed(5, heads, kv_heads, head_dim, dtype)
    assert not q.is_contiguous() and not k.is_contiguous()
    ref_q, ref_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v_before = buf[:, (heads + kv_heads) * head_dim :].clone()
    apply_rope_(q, k, cos, sin)
    exact(q, ref_q)
    exact(k, ref_k)
    assert torch.equal(buf[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("block_h", [1, 2, 4])
def test_head_tiles_straddling_q_and_k(block_h):
    """Several programs per row, tiles holding both q and k heads, a ragged last tile."""
    _, q, k, cos, sin = packed(3, 3, 2, 16, torch.bfloat16, seed=2)
    ref_q, ref_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    _launch(q, k, cos, sin, block_h=block_h)
    exact(q, ref_q)
    exact(k, ref_k)


def test_separate_contiguous_tensors_and_large_theta():
    for dtype in DTYPES:
        _, q, k, cos, sin = packed(4, 4, 4, 32, dtype, seed=4, theta=1_000_000.0)
        q, k = q.contiguous(), k.contiguous()
        ref_q, ref_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        apply_rope_(q, k, cos, sin)
        exact(q, ref_q)
        exact(k, ref_k)


def test_empty_and_rejects_bad_arguments():
    _, q, k, cos, sin = packed(2, 2, 1, 8, torch.float32)
    apply_rope_(q[:0], k[:0], cos[:0], sin[:0])
    # cos in another dtype: torch would promote, not in place
    with pytest.raises(ValueError, match="cos must be"):
        apply_rope_(q, k, cos.double(), sin)
    with pytest.raises(ValueError, match="disagree on rows or D"):
        apply_rope_(q, k[:1], cos, sin)
    with pytest.raises(ValueError, match="q and k must share one of"):
        apply_rope_(q, k.bfloat16(), cos, sin)
    with pytest.raises(ValueError, match="contiguous in their last dimension"):
        apply_rope_(torch.zeros(2, 2, 16)[..., ::2], k, cos, sin)  # last-dim stride 2
    odd = torch.zeros(2, 2, 7)
    with pytest.raises(ValueError, match="head_dim must be even"):
        apply_rope_(odd, odd[:, :1], torch.zeros(2, 7), torch.zeros(2, 7))


# -- GPU -----------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 8, 256])
def test_gpu_ouro_shapes_bit_identical(rows, dtype):
    buf, q, k, cos, sin = packed(rows, 16, 16, 128, dtype, device="cuda", seed=rows, theta=1e6)
    ref_q, ref_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v_before = buf[:, 32 * 128 :].clone()
    apply_rope_(q, k, cos, sin)
    exact(q, ref_q)
    exact(k, ref_k)
    assert torch.equal(buf[:, 32 * 128 :], v_before)


@gpu
@needs_cuda
def test_gpu_gqa_bit_identical():
    _, q, k, cos, sin = packed(64, 24, 4, 128, torch.bfloat16, device="cuda", seed=9)
    ref_q, ref_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    apply_rope_(q, k, cos, sin)
    exact(q, ref_q)
    exact(k, ref_k)


@gpu
@needs_cuda
def test_gpu_cuda_graph():
    buf, q, k, cos, sin = packed(8, 16, 16, 128, torch.bfloat16, device="cuda", seed=3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles outside the capture
        apply_rope_(q, k, cos, sin)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_rope_(q, k, cos, sin)
    for seed in (21, 22):
        nbuf, nq, nk, ncos, nsin = packed(8, 16, 16, 128, torch.bfloat16, device="cuda", seed=seed)
        ref_q, ref_k = apply_rope(nq, ncos, nsin), apply_rope(nk, ncos, nsin)
        buf.copy_(nbuf)
        cos.copy_(ncos)
        sin.copy_(nsin)
        graph.replay()
        torch.cuda.synchronize()
        exact(q, ref_q)
        exact(k, ref_k)
