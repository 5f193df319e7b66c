"""The sampler: greedy, temperature / top-k / top-p with per-request generators, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from rlt_engine.sampling_params import SamplingParams
from rlt_engine.worker.sampler import sample_rows

VOCAB = 32


def _logits(rows: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    g = _gen(seed)
    return [sample_rows(logits[None], [params], [g])[0].token_id for _ in range(n)]


def test_greedy_is_argmax_and_ignores_the_generator():
    logits = _logits()
    params = [SamplingParams()] * 4
    samples = sample_rows(logits, params, [_gen(i) for i in range(4)])
    assert [s.token_id for s in samples] == logits.argmax(-1).tolist()
    assert all(s.logprob is None and s.top_logprobs is None for s in samples)


def test_seeded_sampling_is_reproducible_and_batch_invariant():
    logits = _logits(6)
    p = SamplingParams(temperature=1.0, top_k=10, top_p=0.9, seed=7)
    alone = sample_rows(logits[2:3], [p], [_gen(7)])[0].token_id
    others = [SamplingParams(temperature=0.5 + i, seed=i) for i in range(6)]
    others[2] = p
    gens = [_gen(100 + i) for i in range(6)]
    gens[2] = _gen(7)
    batched = sample_rows(logits, others, gens)
    assert batched[2].token_id == alone
    # a longer stream: one request drawing 20 times alone == interleaved with a neighbour
    g_alone, g_mine, g_other = _gen(3), _gen(3), _gen(4)
    q = SamplingParams(temperature=2.0, seed=3)
    stream_alone = [sample_rows(logits[:1], [q], [g_alone])[0].token_id for _ in range(20)]
    stream_batched = [
        sample_rows(logits[:2], [q, q], [g_mine, g_other])[0].token_id for _ in range(20)
    ]
    assert stream_alone == stream_batched
    assert len(set(stream_alone)) > 1  # really sampling, not greedy


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(1)[0]
    best = int(logits.argmax())
    assert set(_draw(logits, SamplingParams(temperature=5.0, top_k=1), 50)) == {best}
    assert set(_draw(logits, SamplingParams(temperature=5.0, top_p=1e-6), 50)) == {best}


def test_top_k_keeps_only_the_k_best():
    logits = _logits(1, seed=1)[0]
    top5 = set(logits.topk(5).indices.tolist())
    drawn = _draw(logits, SamplingParams(temperature=10.0, top_k=5), 400)
    assert set(drawn) == top5  # all five show up at this temperature, nothing else does


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # mass before token: 0, .5, .8, .95 -> p=0.75 keeps {0, 1}; p=0.85 keeps {0, 1, 2}
    assert set(_draw(logits, SamplingParams(temperature=1.0, top_p=0.75), 300)) == {0, 1}
    assert set(_draw(logits, SamplingParams(temperature=1.0, top_p=0.85), 600)) == {0, 1, 2}


def test_sampling_follows_the_tempered_distribution():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    n = 4000
    for temperature in (1.0, 0.5):
        drawn = _draw(logits, SamplingParams(temperature=temperature), n, seed=11)
        probs = (logits / temperature).softmax(-1).tolist()
        for token, p in enumerate(probs):
            freq = drawn.count(token) / n
            assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3, (temperature, token)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_of_the_chosen_token_and_the_top_n(temperature):
    logits = _logits(3, seed=2)
    params = SamplingParams(temperature=temperature, seed=1, logprobs=4)
    samples = sample_rows(logits, [params] * 3, [_gen(i) for i in range(3)])
    full = logits.float().log_softmax(-1)
    for i, s in enumerate(samples):
        assert s.logprob == pytest.approx(float(full[i, s.token_id]), abs=1e-6)
        assert s.top_logprobs is not None and len(s.top_logprobs) == 4
        ids = [t for t, _ in s.top_logprobs]
        values = [v for _, v in s.top_logprobs]
        assert ids == full[i].topk(4).indices.tolist()
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(full[i].topk(4).values.tolist(), abs=1e-6)
        if temperature == 0.0:
            assert s.token_id == ids[0] and s.logprob == pytest.approx(values[0])


def test_logprobs_zero_gives_the_chosen_token_only():
    (s,) = sample_rows(_logits(1), [SamplingParams(logprobs=0)], [_gen(0)])
    assert s.logprob is not None and s.logprob <= 0 and s.top_logprobs == ()
