"""The one-launch K/V slot copy against torch's indexing (interpreted on the CPU)."""

from __future__ import annotations

import pytest
import torch

from rlt_engine.kernels.kv_copy import copy_slots_


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_slots_equals_torch_indexing(dtype):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(3, 20, 2, 8, generator=gen).to(dtype)
    v = torch.randn(3, 20, 2, 8, generator=gen).to(dtype)
    src = torch.tensor([1, 5, 7, 19, 5])
    dst = torch.tensor([2, 6, 11, 0, 3])  # disjoint from src (exit copies go to other planes)
    want_k, want_v = k.clone(), v.clone()
    want_k[:, dst] = want_k[:, src]
    want_v[:, dst] = want_v[:, src]
    copy_slots_(k, v, src, dst)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_copy_slots_reads_expanded_index_views():
    """One row's source slot repeated for each deeper plane is a stride-0 view (what the
    decode traversal's exit copies pass for a batch of one): every pair must see it."""
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(2, 12, 2, 4, generator=gen)
    v = torch.randn(2, 12, 2, 4, generator=gen)
    dst = torch.tensor([[3, 6, 9]])
    src = torch.tensor([1])[:, None].expand_as(dst).flatten()
    assert src.stride() == (0,)  # the view itself, not a copy
    want_k, want_v = k.clone(), v.clone()
    want_k[:, dst.flatten()] = want_k[:, src]
    want_v[:, dst.flatten()] = want_v[:, src]
    copy_slots_(k, v, src, dst.flatten())
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_rejects_mismatched_arguments():
    k = torch.zeros(1, 4, 1, 4)
    with pytest.raises(ValueError, match="contiguous"):
        copy_slots_(k, torch.zeros(1, 5, 1, 4), torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(ValueError, match="one length"):
        copy_slots_(k, k.clone(), torch.tensor([0, 1]), torch.tensor([1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copy_slots_on_cuda_equals_torch_and_replays_in_a_graph():
    k = torch.randn(24, 1000, 16, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    perm = torch.randperm(1000, device="cuda")
    src, dst = perm[:24], perm[24:48]
    want_k, want_v = k.clone(), v.clone()
    want_k[:, dst] = want_k[:, src]
    want_v[:, dst] = want_v[:, src]
    graph = torch.cuda.CUDAGraph()
    copy_slots_(k.clone(), v.clone(), src, dst)  # compile outside the capture
    with torch.cuda.graph(graph):
        copy_slots_(k, v, src, dst)
    graph.replay()
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
