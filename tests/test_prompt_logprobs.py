"""Prompt logprobs (SamplingParams.prompt_logprobs, the server's echo with logprobs) on CPU in
fp32: each prompt token's logprob and top-k equal the dense oracle's full-depth logits, across
chunked prefill, a prefix that another request cached, requests decoding beside them and
asynchronous scheduling; the generated tokens do not change."""

from __future__ import annotations

import dataclasses

import pytest
from engine_helpers import DEPTH, PROMPTS, check_no_blocks_in_use, make_llm, params_for

from rlt_engine import SamplingParams
from rlt_engine.oracle.reference import reference_forward
from rlt_engine.worker import model_runner

ABS = 2e-5  # fp32: the engine's batched prefill against the oracle's dense forward


@pytest.fixture(autouse=True)
def _no_blocks_in_use_after_each_test():  # type: ignore[no-untyped-def]
    yield
    check_no_blocks_in_use()


def _oracle(llm, prompt: list[int]):  # type: ignore[no-untyped-def]
    model = llm.engine.model
    ref = reference_forward(model.state_dict(), model.config, prompt, [DEPTH] * len(prompt))
    return ref.logits[DEPTH - 1].log_softmax(-1)  # [positions, vocab]: row i predicts i + 1


@pytest.mark.parametrize(
    "options",
    [
        dict(prefill_chunk_size=3, max_num_batched_tokens=8, max_num_seqs=4, block_size=2),
        dict(enable_prefix_caching=True, block_size=2, async_scheduling=True, decode_window=3),
    ],
    ids=["chunked", "prefix-cached-async"],
)
def test_prompt_logprobs_equal_the_oracle_and_change_no_token(ckpt, options, monkeypatch):
    llm = make_llm(ckpt, **options)
    vocab = llm.engine.model_config.vocab_size
    monkeypatch.setattr(model_runner, "SCORE_BYTES", 4 * vocab * 2)  # pieces of two rows
    chosen = [6, 7, 3, 5]
    prompts = [PROMPTS[i] for i in chosen]
    prompts.append(PROMPTS[7][:11] + PROMPTS[3])  # shares a prefix with PROMPTS[7]
    plain = [params_for(i) for i in chosen] + [params_for(0)]
    # every other request asks: the others decode beside them (and may cache the prefix)
    params = [dataclasses.replace(p, prompt_logprobs=(3, None)[i % 2]) for i, p in enumerate(plain)]
    outs = llm.generate(prompts, params)
    alone = llm.generate(prompts, plain)
    for out, prompt, p, free in zip(outs, prompts, params, alone, strict=True):
        assert (out.token_ids, out.exit_depths) == (free.token_ids, free.exit_depths)
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        logp = _oracle(llm, prompt)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for i, got in enumerate(out.prompt_logprobs[1:], start=1):
            assert got.token_id == prompt[i]
            assert got.logprob == pytest.approx(float(logp[i - 1, prompt[i]]), abs=ABS)
            assert got.rank == 1 + int((logp[i - 1] > logp[i - 1, prompt[i]]).sum())
            top = logp[i - 1].topk(3)
            assert [t for t, _ in got.top] == top.indices.tolist()
            assert [v for _, v in got.top] == pytest.approx(top.values.tolist(), abs=ABS)


def test_a_prompt_logprobs_request_is_never_a_prefix_hit_and_never_rides(ckpt):
    """Its prompt is computed whole even where another request cached it, on the prefill
    path (a riding wave has no lm_head over its rows)."""
    llm = make_llm(ckpt, enable_prefix_caching=True, block_size=2)
    engine = llm.engine
    engine.scheduler.trace = []
    prompt = PROMPTS[7]
    llm.generate([prompt], params_for(0))  # caches the prompt's blocks
    hits = engine.blocks.stats.hit_blocks
    (out,) = llm.generate([prompt], dataclasses.replace(params_for(0), prompt_logprobs=0))
    assert engine.blocks.stats.hit_blocks == hits
    assert len(out.prompt_logprobs) == len(prompt)
    scored = [
        p for p in engine.scheduler.trace if any(c.logprob_targets for w in p.prefill for c in w)
    ]
    assert scored and not any(p.wave_rides for p in scored)


def test_bad_prompt_logprobs_raise():
    with pytest.raises(ValueError, match=r"prompt_logprobs must lie in \[0, 20\], got 21"):
        SamplingParams(prompt_logprobs=21)
