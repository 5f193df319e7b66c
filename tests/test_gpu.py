"""GPU-only checks (run on the device: `python -m pytest -m gpu tests/test_gpu.py`)."""

import pytest
import torch

from rlt_engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _run(model_dir, device: str, threshold: float):
    llm = LLM(str(model_dir), dtype="float32", device=device, block_size=4)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, exit_threshold=threshold)
    outs = llm.generate(prompts, params)
    assert llm.engine.blocks.num_used == 0
    return [(o.token_ids, o.exit_depths) for o in outs]


@pytest.mark.parametrize("threshold", [1.0, 0.6])
def test_cuda_engine_matches_cpu_engine_fp32(tiny_ouro_dir, threshold):
    assert _run(tiny_ouro_dir, "cuda", threshold) == _run(tiny_ouro_dir, "cpu", threshold)


def test_cuda_seeded_sampling_is_batch_invariant(tiny_ouro_dir):
    llm = LLM(str(tiny_ouro_dir), dtype="float32", device="cuda")
    p = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], p)[0].token_ids
    other = SamplingParams(max_tokens=7, temperature=1.0, seed=3, ignore_eos=True)
    batched = llm.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4]], [other, p, other])[1].token_ids
    assert alone == batched


def _one_row(model_dir, device: str):
    llm = LLM(str(model_dir), dtype="float32", device=device, block_size=4)
    params = SamplingParams(max_tokens=12, ignore_eos=True, exit_threshold=0.6)
    out = llm.generate([[11, 12, 13, 14, 15, 16, 17]], params)[0]
    return out.token_ids, out.exit_depths


def test_cuda_single_row_with_early_exits_matches_cpu(tiny_ouro_dir):
    """A batch of one with early exits: its exit copies pass one source slot repeated for each
    deeper plane (a stride-0 view the K/V copy kernel once read past)."""
    assert _one_row(tiny_ouro_dir, "cuda") == _one_row(tiny_ouro_dir, "cpu")
