"""Decode attention of one sequence folded into the o_proj (kernels/attend_project, through
worker/attention's `_folds`) in the whole engine on the Triton backend, interpreted on the CPU:
the same tokens and exit depths as the torch backend and as the unfolded launches, with early
exits and max_loops below the depth; batches of more sequences never fold."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from engine_helpers import PROMPTS, check_no_blocks_in_use, make_llm, params_for

from rlt_engine.kernels import attend_project, slot_step
from rlt_engine.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def _no_leaks():
    yield
    check_no_blocks_in_use()


def _spy(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = attend_project.attend_project

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(attend_project, "attend_project", spy)
    return calls


def _outputs(ckpt, backend: str, prompts: list[int]):
    llm = make_llm(ckpt, block_size=4, decode_window=3, attention_backend=backend)
    outs = [llm.generate([PROMPTS[i]], params_for(i))[0] for i in prompts]
    return [(o.token_ids, o.exit_depths) for o in outs]


def test_one_sequence_folds_and_equals_the_torch_path_and_the_unfolded_launches(ckpt, monkeypatch):
    monkeypatch.setattr(slot_step, "_MODE", "")  # the fused rows, as the engine runs on CUDA
    prompts = [1, 6]  # adaptive exits at 0.3; max_loops 2
    reference = _outputs(ckpt, "torch", prompts)
    calls = _spy(monkeypatch)
    assert _outputs(ckpt, "triton", prompts) == reference
    assert calls and set(calls) == {1}  # decode rows of one sequence, one row each
    monkeypatch.setattr(attend_project, "FOLD", False)
    calls.clear()
    assert _outputs(ckpt, "triton", prompts[:1]) == reference[:1]
    assert not calls


def test_batches_of_several_sequences_do_not_fold(ckpt, monkeypatch):
    calls = _spy(monkeypatch)
    llm = make_llm(ckpt, block_size=4, attention_backend="triton", max_num_seqs=2)
    two = SamplingParams(max_tokens=3, ignore_eos=True)
    llm.generate(PROMPTS[:2], [two, two])  # the same lengths: always two sequences
    assert not calls
