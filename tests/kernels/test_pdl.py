"""Programmatic dependent launch (kernels/pdl.py): off on the CPU and under the interpreter;
on a Hopper GPU with RLT_PDL=1 a decode layer's chain of kernels (each reading what the one
before wrote), captured in a CUDA graph and replayed, gives exactly the values of the same
chain launched eagerly without PDL.

GPU tests: pytest tests/kernels/test_pdl.py -m gpu
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlt_engine.kernels import pdl
from rlt_engine.kernels.norm import rms_norm
from rlt_engine.kernels.norm_chain import add_rms_norm
from rlt_engine.kernels.paged_attention import paged_attention
from rlt_engine.kernels.rope_kv_write import rope_write_kv_
from rlt_engine.kernels.small_gemm import GemmConfig, gemm
from rlt_engine.kernels.swiglu import silu_mul
from rlt_engine.models.layers import RotaryEmbedding

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(
    not CUDA or torch.cuda.get_device_capability()[0] < 9, reason="needs a CUDA sm90+ device"
)


def test_off_on_the_cpu(monkeypatch):
    monkeypatch.setenv("RLT_PDL", "1")
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}


def _layer(x, weights, pools, meta):
    """One Ouro-shaped layer of the fast path's kernels (the Triton GEMMs everywhere)."""
    w_qkv, w_o, w_gu, w_down, norms = weights
    k_pool, v_pool = pools
    slots, tables, lens, starts, cos, sin = meta
    rows = x.shape[0]
    split = GemmConfig(64, 128, 4)
    h = rms_norm(x, norms[0], 1e-6)
    qkv = gemm(h, w_qkv, GemmConfig(64, 256, 1)).view(rows, 48, 128)
    q, k, v = qkv.split([16, 16, 16], dim=1)
    rope_write_kv_(q, k, v, cos, sin, k_pool, v_pool, slots)
    attn = paged_attention(q, k_pool, v_pool, tables, lens, starts, 16, 128**-0.5, 1, 2)
    o = gemm(attn.reshape(rows, 2048), w_o, split)
    x, h = add_rms_norm(o, x, norms[2], 1e-6, norms[1], 1e-6)
    act = silu_mul(gemm(h, w_gu, GemmConfig(128, 128, 1)))
    return add_rms_norm(gemm(act, w_down, split), x, norms[4], 1e-6, norms[3], 1e-6)


@gpu
@needs_hopper
def test_gpu_graph_with_pdl_equals_eager_without(monkeypatch):
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to("cuda", torch.bfloat16)

    rows, ctx = 8, 40
    weights = (
        rand(6144, 2048, scale=0.02),
        rand(2048, 2048, scale=0.02),
        rand(11264, 2048, scale=0.02),
        rand(2048, 5632, scale=0.02),
        [rand(2048, scale=0.1) + 1 for _ in range(5)],
    )
    k_pool, v_pool = rand(rows * 64 + 1, 16, 128), rand(rows * 64 + 1, 16, 128)
    tables = torch.arange(rows * 4, dtype=torch.int32, device="cuda").view(rows, 4)
    lens = torch.full((rows,), ctx, dtype=torch.int32, device="cuda")
    starts = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
    slots = (tables[:, (ctx - 1) // 16] * 16 + (ctx - 1) % 16).long()
    positions = torch.full((rows,), ctx - 1, device="cuda")
    cos, sin = RotaryEmbedding(128, 1e6).to("cuda")(positions, torch.bfloat16)
    meta = (slots, tables, lens, starts, cos, sin)
    x = rand(rows, 2048)

    monkeypatch.setenv("RLT_PDL", "0")
    want_pools = (k_pool.clone(), v_pool.clone())
    want = _layer(_layer(x, weights, want_pools, meta)[0], weights, want_pools, meta)

    monkeypatch.setenv("RLT_PDL", "1")
    assert pdl.enabled(torch.device("cuda"))
    static_x = x.clone()
    pools = (k_pool.clone(), v_pool.clone())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        eager = _layer(_layer(static_x, weights, pools, meta)[0], weights, pools, meta)
    torch.cuda.current_stream().wait_stream(stream)
    for got, ref in zip((*eager, *pools), (*want, *want_pools), strict=True):
        assert torch.equal(got, ref)
    graph = torch.cuda.CUDAGraph()
    pools = (k_pool.clone(), v_pool.clone())
    with torch.cuda.graph(graph):
        out = _layer(_layer(static_x, weights, pools, meta)[0], weights, pools, meta)
    for _ in range(3):  # each replay starts from the pools the last one left: same writes
        graph.replay()
        torch.cuda.synchronize()
        for got, ref in zip((*out, *pools), (*want, *want_pools), strict=True):
            assert torch.equal(got, ref)
