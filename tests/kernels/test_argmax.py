"""kernels/argmax.argmax_rows against torch's `x.float().argmax(-1)`: ties (the first index
wins), rows of -inf, NaNs (the first NaN wins), vocabularies that are not a power of two and
span several chunks and several programs (splits), bf16 and fp32; a zero gate skips the work.
CPU: the interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlt_engine.kernels.argmax import (
    BLOCK,
    CHUNKS_PER_SPLIT,
    argmax_partials,
    argmax_rows,
    reduce_reference,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # few distinct values: many ties, some across chunk boundaries
    x = torch.randint(-4, 4, (rows, vocab), generator=g).float()
    x[0] = float("-inf")  # all -inf: index 0
    if rows > 2:
        x[1, vocab // 3] = float("nan")  # a NaN wins over larger numbers
        x[1, vocab - 1] = float("nan")
        x[2, vocab - 1] = 9.0  # the maximum in the last, partial chunk
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "vocab", [1, 7, 256, BLOCK + 3, 3 * BLOCK, 5 * BLOCK * CHUNKS_PER_SPLIT + 17]
)
def test_equals_torch(vocab, dtype):
    x = _logits(5, vocab, dtype, seed=vocab)
    assert torch.equal(argmax_rows(x), x.float().argmax(-1))


@pytest.mark.parametrize("vocab", [7, 5 * BLOCK * CHUNKS_PER_SPLIT + 17])
def test_partials_reduce_to_torch(vocab):
    """The first launch alone (the decode path's: its advance reduces the partials) and the
    reduce's torch reference: the same argmax as torch's, NaNs and ties included."""
    x = _logits(5, vocab, torch.bfloat16, seed=3)
    partials = argmax_partials(x)
    splits = -(-vocab // (min(BLOCK, 1 << (vocab - 1).bit_length()) * CHUNKS_PER_SPLIT))
    assert partials.best.shape == partials.index.shape == (5, splits)
    assert torch.equal(reduce_reference(partials), x.float().argmax(-1))


def test_gate_one_computes_and_zero_skips():
    x = _logits(4, 300, torch.float32, seed=1)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    assert torch.equal(argmax_rows(x, one), x.argmax(-1))
    argmax_rows(x, torch.zeros(1, dtype=torch.bool, device=DEVICE))  # runs, output undefined


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="rows, V"):
        argmax_rows(torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="gate"):
        argmax_rows(torch.zeros(2, 3, device=DEVICE), torch.zeros(2, device=DEVICE))


@gpu
@needs_cuda
def test_gpu_ouro_vocab_under_a_graph():
    x = torch.randn(64, 49152, device="cuda").bfloat16()
    gate = torch.ones(1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        argmax_rows(x, gate)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_rows(x, gate)
    x.copy_(torch.randn(64, 49152, device="cuda").bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x.float().argmax(-1))
