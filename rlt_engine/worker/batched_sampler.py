"""Batched, CUDA-graph-capturable token sampling with a counter-based random stream.

All rows are sampled in one set of kernels: greedy, temperature, top-k, top-p, seeds, logprobs.
There is no host synchronisation and no loop over rows, so `sample` can be captured in a CUDA
graph (one graph per combination of the static flags `any_random`, `any_filter`, `num_logprobs`).

Random numbers come from a counter-based generator: the uniform noise for (seed, counter, vocab
index) is a pure function of those three integers, computed with an integer hash in plain torch
ops. A request's samples therefore do not depend on which other requests share its batch, on its
row, on the device, or on whether the call was replayed from a CUDA graph; the caller only keeps
`counter` (the index of the token being sampled for that request) instead of a generator state.

The hash works on unsigned 32-bit words held in int64 tensors; every intermediate stays below
2**63 in magnitude (a product is a word < 2**32 times a constant of magnitude <= 2**31), so no
operation overflows and CPU and CUDA give bit-identical words and bit-identical uniform values.

    mix(x):  x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16
             (Wellons' "lowbias32" finaliser, all arithmetic mod 2**32; a bijection)
    row key: two lanes, each a chain of `mix` over the 32-bit halves of seed and counter
             a = mix(mix(mix(mix(seed_lo ^ 0x9E3779B9) ^ seed_hi) ^ counter_lo) ^ counter_hi)
             b = mix(mix(mix(mix(seed_hi ^ 0x85EBCA77) ^ seed_lo) ^ counter_hi) ^ counter_lo)
    word:    h(i) = mix(mix(i ^ a) ^ b)                 for vocab index i
    uniform: v = min(fp32(fp32(h) + 0.5) * 2**-32, 1 - 2**-24)   in (0, 1), fp32, fine near 0
    Gumbel:  g = -log(-log1p(-v))                      (-log1p(-v) is Exp(1), fine near 0)

The token is argmax(logits / T + g) over the allowed tokens (Gumbel-max), an exact sample of
softmax(logits / T) restricted to them. Only the uniform values are bit-identical across devices;
log / log1p may differ in the last ulp between CPU and CUDA, which can (very rarely) flip a
near-tie between two candidates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlt_engine.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF
_MIX_C1 = 0x7FEB352D
_MIX_C2 = 0x846CA68B
_LANE_A = 0x9E3779B9
_LANE_B = 0x85EBCA77
# the largest fp32 below 1: the uniform's upper clamp, so that -log1p(-v) stays finite
_ONE_MINUS_ULP = 1.0 - 2.0**-24


@dataclass
class SamplingTensors:
    """Per-row sampling controls, one row per sequence, all on the logits' device."""

    temperature: torch.Tensor  # fp32 [rows]; 0 = greedy
    top_k: torch.Tensor  # int32/int64 [rows]; 0 = off
    top_p: torch.Tensor  # fp32 [rows]; 1.0 = off
    seed: torch.Tensor  # int64 [rows]
    counter: torch.Tensor  # int64 [rows]: index of the token being sampled for that request


@dataclass
class LogitEdits:
    """Per-row logit biases, penalties and min_tokens (SamplingParams') and what each row has
    seen, on the logits' device.

    `seen` int32 [rows, vocab] packs, per token, 2 x its count in the row's output plus 1 if it
    is in the prompt: one tensor keeps both what repetition asks (seen at all: > 0) and what
    frequency and presence ask (the output count: >> 1). `bias_ids` / `bias_values` [rows,
    MAX_LOGIT_BIAS]: each row's biased tokens, padded with token 0 and a bias of 0.
    `stop_ids` [rows, MAX_STOP_IDS] (padded with -1) are held back while `generated` [rows],
    the index of the token being drawn, is below `min_tokens` [rows]. A `constrained` row
    draws from the tokens its `allowed` bitmask sets."""

    presence: torch.Tensor  # fp32 [rows]; 0 = off
    frequency: torch.Tensor  # fp32 [rows]; 0 = off
    repetition: torch.Tensor  # fp32 [rows]; 1 = off
    seen: torch.Tensor  # int32 [rows, vocab]
    bias_ids: torch.Tensor  # int64 [rows, MAX_LOGIT_BIAS]
    bias_values: torch.Tensor  # fp32 [rows, MAX_LOGIT_BIAS]
    stop_ids: torch.Tensor  # int64 [rows, MAX_STOP_IDS]
    min_tokens: torch.Tensor  # int64 [rows]; 0 = off
    generated: torch.Tensor  # int64 [rows]
    constrained: torch.Tensor  # bool [rows]: structured output
    allowed: torch.Tensor  # int32 [rows, ceil(vocab / 32)]: its bitmask (rlt_engine/structured)


SEEN_OUTPUT = 2  # what one output token adds to its `seen` entry (the prompt bit is 1)


def apply_logit_edits(logits: torch.Tensor, e: LogitEdits) -> torch.Tensor:
    """fp32 logits [rows, vocab] with the edits applied in vLLM's order: the logit bias added,
    then repetition over the tokens seen in the prompt or the output (a positive logit divided,
    a negative one multiplied), then frequency x count and presence x (count > 0) over the
    output's; last, a row short of its min_tokens gets -inf on its stop ids and a constrained
    row on the tokens its grammar's mask leaves out (whatever came before, as -inf stays -inf
    through the others). A row with every edit off comes back unchanged (x + 0, x * 1, x / 1
    and x - 0 are exact; only a -0.0 logit comes back +0.0)."""
    logits = logits.scatter_add(1, e.bias_ids, e.bias_values)
    seen = e.seen
    count = (seen >> 1).to(torch.float32)
    repetition = torch.where(seen > 0, e.repetition[:, None], 1.0)
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - e.frequency[:, None] * count
    logits = logits - e.presence[:, None] * (count > 0).to(torch.float32)
    # added, not written: the padding's -1 become token 0, which may be a held-back stop id too
    held = (e.generated < e.min_tokens)[:, None] & (e.stop_ids >= 0)
    minus_inf = torch.zeros(held.shape, dtype=logits.dtype, device=logits.device)
    logits = logits.scatter_add(1, e.stop_ids.clamp(min=0), minus_inf.masked_fill_(held, -math.inf))
    token = torch.arange(logits.shape[1], device=logits.device)
    bit = (e.allowed[:, token // 32] >> (token % 32).to(torch.int32)) & 1
    return logits.masked_fill(e.constrained[:, None] & (bit == 0), -math.inf)


@dataclass
class SampleOutput:
    token: torch.Tensor  # int64 [rows]
    logprob: torch.Tensor | None  # fp32 [rows]: log_softmax(raw fp32 logits)[token]
    top_ids: torch.Tensor | None  # int64 [rows, num_logprobs]
    top_logprobs: torch.Tensor | None  # fp32 [rows, num_logprobs]


# ----------------------------------------------------------------------------- counter-based RNG


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for words x in [0, 2**32); the product never leaves int64.

    A constant c >= 2**31 is replaced by c - 2**32 (same residue, magnitude <= 2**31), so
    |x * c| < 2**63; `& 0xFFFFFFFF` of the (possibly negative) product is its residue mod 2**32.
    """
    if c >= 1 << 31:
        c -= 1 << 32
    return (x * c) & _MASK32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijection on 32-bit words with strong avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_C2)
    return x ^ (x >> 16)


def _halves(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Low and high 32-bit words of an int64 (two's complement; negative values are fine)."""
    v = v.to(torch.int64)
    return v & _MASK32, (v >> 32) & _MASK32


def row_keys(seed: torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit key words (as int64 [rows]) of each (seed, counter) pair."""
    seed_lo, seed_hi = _halves(seed)
    counter_lo, counter_hi = _halves(counter)
    a = _mix(seed_lo ^ _LANE_A)
    a = _mix(a ^ seed_hi)
    a = _mix(a ^ counter_lo)
    a = _mix(a ^ counter_hi)
    b = _mix(seed_hi ^ _LANE_B)
    b = _mix(b ^ seed_lo)
    b = _mix(b ^ counter_hi)
    b = _mix(b ^ counter_lo)
    return a, b


def random_words(seed: torch.Tensor, counter: torch.Tensor, vocab: int) -> torch.Tensor:
    """int64 [rows, vocab] of 32-bit words: h(seed, counter, i) for i in range(vocab)."""
    a, b = row_keys(seed, counter)
    index = torch.arange(vocab, dtype=torch.int64, device=seed.device)
    return _mix(_mix(index[None, :] ^ a[:, None]) ^ b[:, None])


def uniform_noise(seed: torch.Tensor, counter: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 [rows, vocab] uniform in (0, 1); bit-identical on every device and batch shape.

    v = (h + 0.5) / 2**32 in fp32 (each step correctly rounded), clamped below 1. Values near 0
    keep their full 2**-32 resolution, which is the end that decides Gumbel-max winners.
    """
    words = random_words(seed, counter, vocab)
    v = (words.to(torch.float32) + 0.5) * 2.0**-32
    return v.clamp_(max=_ONE_MINUS_ULP)


def gumbel_noise(seed: torch.Tensor, counter: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 [rows, vocab] standard Gumbel noise: -log(E) with E = -log1p(-v) ~ Exp(1)."""
    v = uniform_noise(seed, counter, vocab)
    return v.neg_().log1p_().neg_().log_().neg_()


# ----------------------------------------------------------------------------------- sampling


def _filter_thresholds(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per-row lowest allowed (tempered) logit, fp32 [rows, 1]; -inf where no filter is on.

    Same allowed set as the per-row sampler: top-k keeps logits >= the k-th largest; top-p (over
    the top-k survivors) drops a token when the sorted mass before it already reaches top_p,
    always keeping the best. Tokens tied with the last top-p survivor are kept too.
    """
    vocab = scaled.shape[-1]
    sorted_desc = scaled.sort(dim=-1, descending=True).values
    top_k = top_k.to(torch.int64)
    kth_index = (top_k - 1).clamp(0, vocab - 1)
    kth = sorted_desc.gather(1, kth_index[:, None])
    k_on = ((top_k > 0) & (top_k < vocab))[:, None]
    k_threshold = torch.where(k_on, kth, float("-inf"))

    survivors = torch.where(sorted_desc >= k_threshold, sorted_desc, float("-inf"))
    probs = survivors.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop = mass_before >= top_p[:, None]
    p_threshold = torch.where(drop, float("inf"), survivors).amin(dim=-1, keepdim=True)
    p_threshold = torch.where(top_p[:, None] < 1.0, p_threshold, float("-inf"))
    return torch.maximum(k_threshold, p_threshold)


def sample(
    logits: torch.Tensor,
    t: SamplingTensors,
    *,
    any_random: bool,
    any_filter: bool,
    num_logprobs: int | None,
    gate: torch.Tensor | None = None,
    edits: LogitEdits | None = None,
) -> SampleOutput:
    """Sample one token per row of `logits` [rows, vocab] (any float dtype; fp32 inside).

    The keyword flags are static host values (one CUDA graph per combination):
    any_random=False samples every row greedily without computing noise; any_filter=False skips
    top-k / top-p; num_logprobs=None returns no logprobs, 0 only the chosen token's, n also the
    top n (ids and logprobs of log_softmax of the raw fp32 logits, temperature not applied).
    Rows with temperature 0 are greedy in every variant; greedy equals `logits.float().argmax(-1)`.

    `gate` (the fused decode path, Triton backends only): a one-element device tensor. The
    greedy-only variant then takes the argmax with kernels/argmax, which a zero gate skips
    (no row needs a token: the tokens are undefined).

    `edits` (the `logit_edits` variant): logit biases and penalties, applied to the logits the
    token is drawn from, greedy rows' too (`apply_logit_edits`); the logprobs stay those of the
    raw logits.
    """
    if gate is not None and not any_random and num_logprobs is None and edits is None:
        from rlt_engine.kernels.argmax import argmax_rows

        return SampleOutput(argmax_rows(logits, gate), None, None, None)
    raw = logits = logits.float()
    if edits is not None:
        logits = apply_logit_edits(logits, edits)
    greedy = logits.argmax(dim=-1)
    if any_random:
        temperature = t.temperature.to(torch.float32)
        is_greedy = temperature <= 0.0
        scaled = logits / torch.where(is_greedy, 1.0, temperature)[:, None]
        if any_filter:
            threshold = _filter_thresholds(scaled, t.top_k, t.top_p.to(torch.float32))
            scaled = torch.where(scaled >= threshold, scaled, float("-inf"))
        scores = scaled.add_(gumbel_noise(t.seed, t.counter, logits.shape[-1]))
        token = torch.where(is_greedy, greedy, scores.argmax(dim=-1))
    else:
        token = greedy

    if num_logprobs is None:
        return SampleOutput(token, None, None, None)
    logprobs = raw.log_softmax(dim=-1)
    chosen = logprobs.gather(1, token[:, None]).squeeze(1)
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    else:
        top_logprobs = logprobs.new_empty((logits.shape[0], 0))
        top_ids = token.new_empty((logits.shape[0], 0))
    return SampleOutput(token, chosen, top_ids, top_logprobs)


def _as_int64(value: int) -> int:
    """Wrap any Python int into the signed 64-bit range (the low 64 bits, two's complement)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def sampling_tensors_for(
    params: list[SamplingParams],
    seeds: list[int],
    counters: list[int],
    device: torch.device | str,
) -> tuple[SamplingTensors, bool, bool, int | None]:
    """Tensors and static flags (any_random, any_filter, num_logprobs) for a list of requests.

    Greedy rows (p.greedy) get temperature 0 and never count towards any_random / any_filter.
    Seeds are wrapped to their low 64 bits (two's complement int64).
    """
    if not len(params) == len(seeds) == len(counters):
        raise ValueError(
            f"need one seed and one counter per row: {len(params)} params, "
            f"{len(seeds)} seeds, {len(counters)} counters"
        )
    tensors = SamplingTensors(
        temperature=torch.tensor(
            [0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32
        ).to(device),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64).to(device),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32).to(device),
        seed=torch.tensor([_as_int64(s) for s in seeds], dtype=torch.int64).to(device),
        counter=torch.tensor([_as_int64(c) for c in counters], dtype=torch.int64).to(device),
    )
    random_rows = [p for p in params if not p.greedy]
    any_random = bool(random_rows)
    any_filter = any(p.top_k > 0 or p.top_p < 1.0 for p in random_rows)
    requested = [p.logprobs for p in params if p.logprobs is not None]
    num_logprobs = max(requested) if requested else None
    return tensors, any_random, any_filter, num_logprobs
