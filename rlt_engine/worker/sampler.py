"""Token sampling: greedy, or temperature / top-k / top-p with a per-request generator.

Every row is sampled on its own with its own seeded generator, so a request's samples do not
depend on which other requests share its batch.
"""

from __future__ import annotations

import torch

from rlt_engine.core.plan import Sample
from rlt_engine.sampling_params import SamplingParams


def sample_rows(
    logits: torch.Tensor,  # [rows, vocab]
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[Sample]:
    logits = logits.float()
    greedy = logits.argmax(dim=-1).tolist()
    samples = []
    for i, p in enumerate(params):
        token = greedy[i] if p.greedy else _sample_one(logits[i], p, generators[i])
        samples.append(_with_logprobs(logits[i], token, p.logprobs))
    return samples


def _sample_one(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (always keep the best)
        drop = (cumulative - sorted_logits.softmax(-1)) >= p.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _with_logprobs(logits: torch.Tensor, token: int, top_n: int | None) -> Sample:
    if top_n is None:
        return Sample(token)
    logprobs = logits.log_softmax(-1)
    top = ()
    if top_n > 0:
        values, ids = logprobs.topk(top_n)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return Sample(token, float(logprobs[token]), top)
