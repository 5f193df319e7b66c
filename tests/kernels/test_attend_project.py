"""kernels/attend_project: one decode row's attention folded into the o_proj, against its
unfused reference (the dense fp32 attention, rounded to q's dtype, times w_o). Runs under the
Triton interpreter on CPU (tests/kernels/conftest.py), compiled on a GPU (`gpu` tests)."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import BF16_TOL, CUDA, FP32_TOL, Case

from rlt_engine.kernels import attend_project as ap
from rlt_engine.kernels.attend_project import attend_project
from rlt_engine.kernels.split_sums import SplitSums

gpu = pytest.mark.gpu


def _case(seq_len, heads, kv_heads, d, block_size, dtype=torch.float32, device="cpu", n=48):
    case = Case([(1, seq_len)], heads, kv_heads, d, block_size, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seq_len)
    w_o = (torch.randn(n, heads * d, generator=gen) / (heads * d) ** 0.5).to(device, dtype)
    return case, w_o


def _run(case: Case, w_o: torch.Tensor, settled: bool = True, **tiles) -> SplitSums:
    return attend_project(
        case.q, case.k, case.v, case.block_tables, case.seq_lens, case.block_size, case.scale,
        w_o, settled=settled, **tiles,
    )  # fmt: skip


def _reference(case: Case, w_o: torch.Tensor) -> torch.Tensor:
    """The unfused values: fp32 attention, rounded to q's dtype as the attention launch stores
    it, then the o_proj in fp32."""
    attn = case.reference().to(case.q.dtype).float()
    return attn.reshape(1, -1) @ w_o.float().cpu().T


@pytest.mark.parametrize(
    ("seq_len", "heads", "kv_heads", "block_size", "tiles"),
    [
        (1, 4, 4, 4, {}),  # the row's own key only
        (13, 4, 4, 4, {}),  # inside the first tile: settled keys and the own key merged
        (37, 4, 2, 8, {"block_keys": 16}),  # GQA, three tiles: the walk after the wait
        (70, 6, 2, 16, {"heads": 2, "block_n": 16}),  # a program's heads across kv groups
        (33, 4, 4, 4, {"heads": 2, "block_n": 32, "block_keys": 16}),  # N 48: a ragged tile
    ],
)
def test_equals_attention_then_the_o_proj(seq_len, heads, kv_heads, block_size, tiles):
    case, w_o = _case(seq_len, heads, kv_heads, 16, block_size)
    out = _run(case, w_o, **tiles)
    splits = heads // tiles.get("heads", 1)
    assert out.parts.shape == (splits, 1, w_o.shape[0]) and out.dtype == torch.float32
    torch.testing.assert_close(out.total(), _reference(case, w_o), atol=FP32_TOL, rtol=FP32_TOL)


def test_bf16_rounds_the_attention_output_as_the_launch_stores_it():
    case, w_o = _case(29, 4, 4, 32, 8, dtype=torch.bfloat16)
    out = _run(case, w_o)
    ref = _reference(case, w_o)
    # the fp32 partials are summed once and rounded to bf16, as add + norm would
    torch.testing.assert_close(out.total().float(), ref, atol=BF16_TOL, rtol=BF16_TOL)
    # the partials themselves: fp32 products of bf16-rounded attention rows, not of fp32 ones
    attn = case.reference().to(torch.bfloat16).float().reshape(4, 32)
    w = w_o.float().reshape(w_o.shape[0], 4, 32)
    per_head = torch.einsum("nhd,hd->hn", w, attn)
    torch.testing.assert_close(out.parts[:, 0], per_head, atol=1e-4, rtol=1e-4)


def test_a_row_with_no_key_projects_zeros():
    case, w_o = _case(5, 4, 4, 16, 4)
    case.seq_lens.zero_()
    assert torch.equal(_run(case, w_o).parts, torch.zeros(4, 1, w_o.shape[0]))


def test_config_owns_the_o_proj_in_about_one_program_an_sm():
    assert ap.config(2048, 16) == (ap.HEADS, ap.BLOCK_N)  # Ouro-1.4B: 16 x 8 programs
    assert 16 * 2048 // ap.BLOCK_N // ap.HEADS == 128
    assert ap.config(48, 4) == (ap.HEADS, 64)  # a small N: one tile
    assert ap.config(48, 5)[0] == (1 if 5 % ap.HEADS else ap.HEADS)


def test_refuses_what_it_cannot_run():
    case, w_o = _case(9, 4, 4, 16, 4)
    two = Case([(1, 9), (1, 4)], 4, 4, 16, 4)
    with pytest.raises(ValueError, match="one decode row"):
        _run(two, w_o)
    with pytest.raises(ValueError, match="w_o must be"):
        _run(case, w_o[:, :32])
    with pytest.raises(ValueError, match="power of 2 dividing"):
        _run(case, w_o, heads=3)
    with pytest.raises(ValueError, match="int32"):
        attend_project(
            case.q,
            case.k,
            case.v,
            case.block_tables.long(),
            case.seq_lens,
            4,
            1.0,
            w_o,
            settled=True,
        )


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("seq_len", [1, 96, 130, 199])
def test_gpu_ouro_shape_equals_the_unfused_launches(seq_len):
    """Ouro-1.4B's shapes in bf16 against paged attention then the o_proj GEMM: the same
    values up to fp32 order (the attention rows may round one bf16 ulp apart)."""
    from rlt_engine.kernels.paged_attention import paged_attention

    case, w_o = _case(seq_len, 16, 16, 128, 16, dtype=torch.bfloat16, device="cuda", n=2048)
    out = _run(case, w_o).total()
    attn = paged_attention(
        case.q, case.k, case.v, case.block_tables, case.seq_lens, case.query_start,
        case.block_size, case.scale, 1,
    )  # fmt: skip
    unfused = torch.nn.functional.linear(attn.reshape(1, -1), w_o)
    torch.testing.assert_close(out.float(), unfused.float(), atol=BF16_TOL, rtol=BF16_TOL)
    torch.testing.assert_close(out.float().cpu(), _reference(case, w_o), atol=BF16_TOL,
                               rtol=BF16_TOL)  # fmt: skip


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("settled", [True, False])
def test_gpu_graph_replays_equal_eager(settled):
    """Replayed, with the settled keys read before the PDL wait or after it: the same bits."""
    case, w_o = _case(96, 16, 16, 128, 16, dtype=torch.bfloat16, device="cuda", n=2048)
    eager = _run(case, w_o).parts.clone()
    graph = torch.cuda.CUDAGraph()
    _run(case, w_o, settled)  # compiled before capture
    with torch.cuda.graph(graph):
        out = _run(case, w_o, settled)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.parts, eager)
