"""The one-launch LAST_EXITED exit copies (kernels/kv_copy.py) against their torch reference
and against a plain loop over rows, planes and layers: random exits and loops over 2-4 planes,
rows that exit at the deepest plane, idle rows. CPU: the interpreter; GPU: compiled (with PDL
on sm_90+) and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlt_engine.kernels.kv_copy import exit_copies_, exit_copies_reference

CUDA = torch.cuda.is_available()
BLOCK_SIZE = 4


def _case(b: int, planes: int, seed: int, device: str = "cpu", dtype=torch.float32) -> dict:
    """Pools [3 layers, slots, 2 heads, 8] and b rows, each with its own blocks in every plane
    (distinct physical blocks, as the block manager gives them)."""
    g = torch.Generator().manual_seed(seed)
    width = 3
    blocks = torch.randperm(b * planes * width + 5, generator=g)[: b * planes * width]
    tables = blocks.view(b, planes, width).to(torch.int32)
    slots = (b * planes * width + 5) * BLOCK_SIZE
    k = torch.randn(3, slots, 2, 8, generator=g).to(dtype)
    v = torch.randn(3, slots, 2, 8, generator=g).to(dtype)
    loop = torch.randint(0, planes, (b,), generator=g)
    position = torch.randint(0, width * BLOCK_SIZE, (b,), generator=g)
    block, offset = position // BLOCK_SIZE, position % BLOCK_SIZE
    own = tables[torch.arange(b), loop, block].long() * BLOCK_SIZE + offset
    exits = torch.randint(0, 3, (b,), generator=g) > 0
    case = dict(
        k=k, v=v, exits=exits, loop=loop, block=block, offset=offset, src=own, tables=tables
    )
    return {name: t.to(device) for name, t in case.items()}


def _by_hand(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = case["k"].clone(), case["v"].clone()
    for row in range(case["tables"].shape[0]):
        if not case["exits"][row]:
            continue
        for plane in range(int(case["loop"][row]) + 1, case["tables"].shape[1]):
            dst = int(case["tables"][row, plane, case["block"][row]]) * BLOCK_SIZE
            dst += int(case["offset"][row])
            k[:, dst] = k[:, case["src"][row]]
            v[:, dst] = v[:, case["src"][row]]
    return k, v


def _run(fn, case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    c = {name: t.clone() for name, t in case.items()}
    fn(**c, block_size=BLOCK_SIZE)
    return c["k"], c["v"]


@pytest.mark.parametrize("planes", [1, 2, 4])
@pytest.mark.parametrize("b", [1, 6])
def test_kernel_and_reference_equal_the_plain_loop(b, planes):
    for seed in range(3):
        case = _case(b, planes, seed + 7 * b)
        want = _by_hand(case)
        for fn in (exit_copies_reference, exit_copies_):
            got = _run(fn, case)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), fn.__name__


def test_the_cases_reach_every_branch():
    """Rows that exit with deeper planes to fill, that exit at the deepest plane (nothing to
    copy), and that stay, all occur; and the copies do change the pools."""
    seen = {"copies": False, "deepest": False, "stays": False}
    for seed in range(3):
        case = _case(6, 4, seed + 42)
        deepest = case["loop"] == 3
        seen["copies"] |= bool((case["exits"] & ~deepest).any())
        seen["deepest"] |= bool((case["exits"] & deepest).any())
        seen["stays"] |= bool((~case["exits"]).any())
        assert not torch.equal(_by_hand(case)[0], case["k"])
    assert all(seen.values()), seen


def test_rejects_mismatched_arguments():
    case = _case(3, 2, 0)
    with pytest.raises(ValueError, match="contiguous"):
        _run(exit_copies_, {**case, "v": case["v"][:, :-1]})
    with pytest.raises(ValueError, match=r"one per row"):
        _run(exit_copies_, {**case, "loop": case["loop"][:2]})


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_on_cuda_equals_the_reference_and_replays_in_a_graph():
    case = _case(64, 4, 3, "cuda", torch.bfloat16)
    want = _run(exit_copies_reference, case)
    c = {name: t.clone() for name, t in case.items()}
    _run(exit_copies_, case)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        exit_copies_(**c, block_size=BLOCK_SIZE)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(c["k"], want[0]) and torch.equal(c["v"], want[1])
