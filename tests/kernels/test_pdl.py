"""Programmatic dependent launch (kernels/pdl.py): the decode layer's Triton kernels chained
with PDL give exactly the bits they give without it, eagerly and replayed from a CUDA graph.

A kernel that read its predecessor's output before `griddepcontrol.wait`, wrote before it, or
let a program exit without it would race with the kernel before it; in a chain of layers at
Ouro's shapes (norm -> qkv GEMM -> RoPE + KV write -> paged attention -> o_proj with split-K ->
residual + norm -> gate/up + SwiGLU -> down with split-K -> residual + norm), with the GEMMs
prefetching their weights while the predecessor runs, such a race shows up as changed values.
On CPU (interpreter) PDL is never on; only the switch itself is tested there.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlt_engine.kernels import pdl
from rlt_engine.kernels.gate_up_swiglu import gate_up_silu
from rlt_engine.kernels.norm import rms_norm
from rlt_engine.kernels.norm_chain import add_rms_norm
from rlt_engine.kernels.paged_attention import paged_attention
from rlt_engine.kernels.rope_kv_write import rope_write_kv_
from rlt_engine.kernels.small_gemm import GemmConfig, gemm
from rlt_engine.kernels.ws_gemm import available as ws_available

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(
    not CUDA or torch.cuda.get_device_capability()[0] < 9, reason="needs an sm_90+ GPU"
)


def test_off_on_cpu_and_launch_options():
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_options(False) == {}
    assert pdl.launch_options(True) == {"launch_pdl": True}


def test_prefetch_columns_stay_in_the_range_and_the_budget(monkeypatch):
    monkeypatch.setattr(pdl, "PREFETCH_BYTES", 16 << 20)
    # Ouro o_proj, 4 splits of 512 columns: 8 MB fits, every program prefetches its range
    assert pdl.prefetch_k(2048, 4, 512, 256, 2) == 512
    # Ouro down_proj, 4 splits of 1408: 16 MB of 23 -> 1024 columns per program
    assert pdl.prefetch_k(2048, 4, 1408, 128, 2) == 1024
    # a 200 MB lm_head: still one K tile per program
    assert pdl.prefetch_k(49152, 1, 2048, 128, 2) == 128
    monkeypatch.setattr(pdl, "PREFETCH_BYTES", 0)
    assert pdl.prefetch_k(2048, 4, 512, 256, 2) == 0


class _Layers:
    """Four decode layers of Ouro-1.4B's shapes (bf16, 8 rows at 96 keys each)."""

    rows, hidden, heads, head_dim, inter, keys, block = 8, 2048, 16, 128, 5632, 96, 16

    def __init__(self) -> None:
        gen = torch.Generator(device="cuda").manual_seed(0)

        def rand(*shape, scale=1.0):
            return (torch.randn(shape, device="cuda", generator=gen) * scale).bfloat16()

        h, d = self.hidden, self.heads * self.head_dim
        self.layers = [
            {
                "qkv": rand(3 * d, h, scale=h**-0.5),
                "o": rand(h, d, scale=d**-0.5),
                "gate_up": rand(2 * self.inter, h, scale=h**-0.5),
                "down": rand(h, self.inter, scale=self.inter**-0.5),
                "norms": [1 + rand(h, scale=0.1) for _ in range(4)],
            }
            for _ in range(4)
        ]
        self.x = rand(self.rows, h)
        blocks_per_seq = self.keys // self.block
        slots = self.rows * self.keys
        self.pools = [
            (rand(slots, self.heads, self.head_dim), rand(slots, self.heads, self.head_dim))
            for _ in self.layers
        ]
        self.block_tables = torch.arange(
            self.rows * blocks_per_seq, dtype=torch.int32, device="cuda"
        ).view(self.rows, blocks_per_seq)
        self.seq_lens = torch.full((self.rows,), self.keys, dtype=torch.int32, device="cuda")
        self.query_start = torch.arange(self.rows + 1, dtype=torch.int32, device="cuda")
        # each row writes the last key of its own sequence
        self.slot_mapping = torch.arange(self.rows, device="cuda") * self.keys + self.keys - 1
        angles = rand(self.rows, self.head_dim).float()
        self.cos, self.sin = angles.cos().bfloat16(), angles.sin().bfloat16()

    def run(self, kernel: str = "triton") -> torch.Tensor:
        """`kernel`: the small GEMMs' ("ws": the warp-specialised one, whose weight stream runs
        ahead of its wait; gate/up + SwiGLU stays the Triton kernel)."""
        wide = GemmConfig(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3)
        split = GemmConfig(64, 128, 4, 4, 4, kernel=kernel)
        qkv_config = GemmConfig(64, 256, 1, 4, 3, kernel=kernel)
        heads, dim = self.heads, self.head_dim
        x = self.x
        h = rms_norm(x, self.layers[0]["norms"][0], 1e-6)
        for layer, (k_pool, v_pool) in zip(self.layers, self.pools, strict=True):
            qkv = gemm(h, layer["qkv"], qkv_config).view(self.rows, 3 * heads, dim)
            q, k, v = qkv[:, :heads], qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
            rope_write_kv_(q, k, v, self.cos, self.sin, k_pool, v_pool, self.slot_mapping)
            attn = paged_attention(
                q, k_pool, v_pool, self.block_tables, self.seq_lens, self.query_start,
                self.block, dim**-0.5, 1, prefetch_kv=True,
            )  # fmt: skip
            o = gemm(attn.reshape(self.rows, heads * dim), layer["o"], split, prefetch_whole=True)
            n1, n2, n3, n4 = layer["norms"]
            x, h = add_rms_norm(o, x, n2, 1e-6, y_weight=n1)
            act = gate_up_silu(h, layer["gate_up"], wide)
            down = gemm(act, layer["down"], split)
            x, h = add_rms_norm(down, x, n4, 1e-6, y_weight=n3)
        return h

    def reset_pools(self, saved) -> None:
        for (k_pool, v_pool), (k0, v0) in zip(self.pools, saved, strict=True):
            k_pool.copy_(k0)
            v_pool.copy_(v0)


@gpu
@needs_hopper
@pytest.mark.parametrize("kernel", ["triton", "ws"])
def test_gpu_pdl_chain_equals_no_pdl_eager_and_graphed(monkeypatch, kernel):
    if kernel == "ws" and not ws_available(torch.device("cuda")):
        pytest.skip("the warp-specialised GEMM needs compute capability 9.0 and Gluon")
    case = _Layers()
    saved = [(k.clone(), v.clone()) for k, v in case.pools]
    monkeypatch.setattr(pdl, "_DISABLED", True)
    assert not pdl.enabled(torch.device("cuda"))
    plain = case.run(kernel)
    case.reset_pools(saved)

    monkeypatch.setattr(pdl, "_DISABLED", False)
    assert pdl.enabled(torch.device("cuda"))
    for _ in range(3):  # eager with PDL, several times (a race need not show every run)
        assert torch.equal(case.run(kernel), plain)
        case.reset_pools(saved)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        case.run(kernel)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    case.reset_pools(saved)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = case.run(kernel)
    for _ in range(20):
        case.reset_pools(saved)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain)
