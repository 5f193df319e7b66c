"""The batched sampler: counter-based noise, Gumbel-max sampling, top-k / top-p, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlt_engine.oracle.reference import edited_greedy
from rlt_engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from rlt_engine.structured import mask_words
from rlt_engine.worker.batched_sampler import (
    SEEN_OUTPUT,
    LogitEdits,
    SamplingTensors,
    _filter_thresholds,
    _mul32,
    apply_logit_edits,
    random_words,
    row_keys,
    sample,
    sampling_tensors_for,
    uniform_noise,
)
from rlt_engine.worker.slot_batch import MAX_STOP_IDS

try:
    from scipy.stats import chi2 as _scipy_chi2
except ImportError:  # pragma: no cover - scipy is optional
    _scipy_chi2 = None

VOCAB = 32
M32 = 0xFFFFFFFF
# chi-square critical values at alpha = 1e-3 by degrees of freedom (used when scipy is absent)
CHI2_CRITICAL_1E3 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def _logits(rows: int = 4, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _tensors(
    rows: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    counters: torch.Tensor | None = None,
) -> SamplingTensors:
    return SamplingTensors(
        temperature=torch.full((rows,), temperature),
        top_k=torch.full((rows,), top_k, dtype=torch.int64),
        top_p=torch.full((rows,), top_p),
        seed=torch.full((rows,), seed, dtype=torch.int64),
        counter=torch.arange(rows, dtype=torch.int64) if counters is None else counters,
    )


def _draws(logits: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """n samples of one distribution: one batched call, the same logits row, counters 0..n-1."""
    t = _tensors(n, **kw)
    any_filter = kw.get("top_k", 0) > 0 or kw.get("top_p", 1.0) < 1.0
    rows = logits[None].expand(n, -1)
    return sample(rows, t, any_random=True, any_filter=any_filter, num_logprobs=None).token


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value at alpha 1e-3) over the tokens with nonzero probability."""
    support = probs > 0
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    stat = float(((counts - expected)[support] ** 2 / expected[support]).sum())
    df = int(support.sum()) - 1
    critical = float(_scipy_chi2.isf(1e-3, df)) if _scipy_chi2 else CHI2_CRITICAL_1E3[df]
    return stat, critical


# ---------------------------------------------------------------- reference (pure-Python) hash


def _py_mix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _py_word(seed: int, counter: int, index: int) -> int:
    s_lo, s_hi = seed & M32, (seed >> 32) & M32  # Python ints: two's complement, infinite width
    c_lo, c_hi = counter & M32, (counter >> 32) & M32
    a = _py_mix(_py_mix(_py_mix(_py_mix(s_lo ^ 0x9E3779B9) ^ s_hi) ^ c_lo) ^ c_hi)
    b = _py_mix(_py_mix(_py_mix(_py_mix(s_hi ^ 0x85EBCA77) ^ s_lo) ^ c_hi) ^ c_lo)
    return _py_mix(_py_mix(index ^ a) ^ b)


def _py_uniform(word: int) -> np.float32:
    v = (np.float32(word) + np.float32(0.5)) * np.float32(2.0**-32)
    return min(v, np.float32(1.0 - 2.0**-24))


EXTREME_SEEDS = [
    0,
    1,
    7,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**62 + 12345,
    2**63 - 1,
    -1,
    -(2**63),
]
EXTREME_COUNTERS = [0, 1, 2, 2**31, 2**32 - 1, 2**32 + 5, 2**62, 2**63 - 1, 123456789]


def test_hash_matches_a_big_int_reference_without_overflow():
    for c in (0x7FEB352D, 0x846CA68B):
        x = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=torch.int64)
        assert _mul32(x, c).tolist() == [(int(v) * c) & M32 for v in x]
    seeds = torch.tensor(EXTREME_SEEDS, dtype=torch.int64)
    counters = torch.tensor([*EXTREME_COUNTERS, 3, 4], dtype=torch.int64)
    words = random_words(seeds, counters, 6)
    assert int(words.min()) >= 0 and int(words.max()) <= M32
    for row, (s, c) in enumerate(zip(EXTREME_SEEDS, counters.tolist(), strict=True)):
        assert words[row].tolist() == [_py_word(s, c, i) for i in range(6)], (s, c)
    # large vocabulary indices, and the uniform values bit for bit
    big = random_words(seeds[-2:], counters[-2:], 300_000)
    uniform = uniform_noise(seeds[-2:], counters[-2:], 300_000)
    for row in range(2):
        s, c = EXTREME_SEEDS[-2 + row], int(counters[-2 + row])
        for i in (0, 65_535, 65_536, 131_071, 299_999):
            assert int(big[row, i]) == _py_word(s, c, i)
            assert uniform[row, i].numpy().view(np.uint32) == _py_uniform(_py_word(s, c, i)).view(
                np.uint32
            )


def test_uniform_noise_lies_in_the_open_unit_interval_and_looks_uniform():
    seeds = torch.full((500,), 42, dtype=torch.int64)
    u = uniform_noise(seeds, torch.arange(500), 2000)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    histogram = torch.histc(u, 64, 0, 1).double()
    expected = u.numel() / 64
    stat = float(((histogram - expected) ** 2 / expected).sum())
    assert stat < 112.3  # chi-square, 63 degrees of freedom, alpha 1e-4
    # no visible correlation between neighbouring vocab indices or neighbouring counters
    flat = lambda a: (a - 0.5).flatten()  # noqa: E731
    for x, y in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):
        corr = float((flat(x) * flat(y)).mean() / (1 / 12))
        assert abs(corr) < 0.005
    # the extremes stay finite
    assert _py_uniform(M32) == np.float32(1.0 - 2.0**-24) and _py_uniform(0) == np.float32(2**-33)


def test_noise_is_bit_identical_in_any_batch_shape_and_vocab_prefix():
    gen = torch.Generator().manual_seed(5)
    seeds = torch.randint(-(2**62), 2**62, (20,), generator=gen)
    counters = torch.randint(0, 2**40, (20,), generator=gen)
    full = uniform_noise(seeds, counters, 1000)
    perm = torch.randperm(20, generator=gen)
    assert torch.equal(uniform_noise(seeds[perm], counters[perm], 1000), full[perm])
    for i in (0, 7, 19):
        assert torch.equal(
            uniform_noise(seeds[i : i + 1], counters[i : i + 1], 1000), full[i : i + 1]
        )
    assert torch.equal(uniform_noise(seeds, counters, 100), full[:, :100])
    # also in a larger batch of unrelated rows
    more = torch.cat([counters, counters + 1])
    assert torch.equal(uniform_noise(torch.cat([seeds, seeds]), more, 1000)[:20], full)


def test_counters_and_seeds_give_different_streams():
    seeds = torch.zeros(200, dtype=torch.int64)
    keys = torch.stack(row_keys(seeds, torch.arange(200)), dim=1)
    assert len({tuple(k) for k in keys.tolist()}) == 200
    other = torch.stack(row_keys(seeds + 1, torch.arange(200)), dim=1)
    assert not (keys == other).all(dim=1).any()
    logits = _logits(1, seed=3)[0]
    stream = _draws(logits, 200, temperature=2.0, seed=9)
    assert len(set(stream.tolist())) > 10  # really sampling
    assert not torch.equal(stream, _draws(logits, 200, temperature=2.0, seed=10))
    assert torch.equal(stream, _draws(logits, 200, temperature=2.0, seed=9))  # reproducible


def test_greedy_is_argmax_with_ties_and_in_any_dtype():
    logits = _logits(6)
    logits[0] = torch.tensor([1.0, 3.0, 3.0] + [0.0] * (VOCAB - 3))  # tie: lowest index wins
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = logits.to(dtype)
        out = sample(x, _tensors(6), any_random=False, any_filter=False, num_logprobs=None)
        assert torch.equal(out.token, x.float().argmax(-1)) and out.token.dtype == torch.int64
        assert out.logprob is None and out.top_ids is None and out.top_logprobs is None
    assert int(out.token[0]) == 1
    # temperature-0 rows stay greedy when other rows sample (and filters are on)
    t = _tensors(6, temperature=0.0, top_k=3, top_p=0.5)
    t.temperature[1::2] = 5.0
    out = sample(logits, t, any_random=True, any_filter=True, num_logprobs=None)
    assert torch.equal(out.token[0::2], logits.argmax(-1)[0::2])


def test_seeded_sampling_is_batch_invariant():
    logits = _logits(6, seed=4)
    mine = SamplingParams(temperature=1.0, top_k=10, top_p=0.9, seed=7)
    plain = SamplingParams(temperature=1.3, seed=8)  # no filter: alone it runs any_filter=False
    others = [
        SamplingParams(),
        SamplingParams(temperature=0.5, top_k=3, logprobs=2),
        SamplingParams(temperature=2.0, top_p=0.5),
        SamplingParams(temperature=0.7),
        SamplingParams(logprobs=0),
    ]
    for request, seed in ((mine, 7), (plain, 8)):
        row = logits[2]
        alone_tokens, alone_logprobs = [], []
        for counter in range(30):
            t, *flags = sampling_tensors_for([request], [seed], [counter], "cpu")
            out = sample(row[None], t, any_random=flags[0], any_filter=flags[1], num_logprobs=0)
            alone_tokens.append(int(out.token[0]))
            alone_logprobs.append(float(out.logprob[0]))
        assert len(set(alone_tokens)) > 1
        for position in range(6):
            batch_params = [*others[:position], request, *others[position:]]
            batch_logits = torch.cat([logits[:position], row[None], logits[position:5]])
            for counter in (0, 11, 29):
                seeds = [100 + i for i in range(6)]
                counters = [counter * 3 + i for i in range(6)]
                seeds[position], counters[position] = seed, counter
                t, any_random, any_filter, n = sampling_tensors_for(
                    batch_params, seeds, counters, "cpu"
                )
                assert any_random and any_filter and n == 2
                out = sample(
                    batch_logits, t, any_random=any_random, any_filter=any_filter, num_logprobs=n
                )
                assert int(out.token[position]) == alone_tokens[counter]
                assert float(out.logprob[position]) == pytest.approx(
                    alone_logprobs[counter], abs=1e-6
                )


def _reference_allowed(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The allowed-token mask of today's per-row sampler (sampler._sample_one), one row."""
    logits = scaled.clone()
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = (cumulative - sorted_logits.softmax(-1)) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits > float("-inf")


def test_filters_allow_exactly_the_tokens_of_the_per_row_sampler():
    gen = torch.Generator().manual_seed(8)
    rows, vocab = 120, 50
    logits = torch.randn(rows, vocab, generator=gen) * 2
    logits[::7, 5:9] = logits[::7, 5:6]  # ties around the cut
    k_choices = torch.tensor([0, 1, 2, 5, 17, 49, 50, 60])
    p_choices = torch.tensor([1.0, 0.9, 0.5, 0.3, 1e-6, 0.999])
    top_k = k_choices[torch.randint(0, 8, (rows,), generator=gen)]
    top_p = p_choices[torch.randint(0, 6, (rows,), generator=gen)]
    temperature = torch.rand(rows, generator=gen) * 2 + 0.1
    scaled = logits / temperature[:, None]
    allowed = scaled >= _filter_thresholds(scaled, top_k, top_p)
    for i in range(rows):
        expected = _reference_allowed(scaled[i], int(top_k[i]), float(top_p[i]))
        assert torch.equal(allowed[i], expected), (i, int(top_k[i]), float(top_p[i]))
    # and sampling (many counters per row) never leaves the allowed set
    t = SamplingTensors(
        temperature, top_k, top_p, torch.arange(rows), torch.zeros(rows, dtype=torch.int64)
    )
    for counter in range(20):
        t.counter = torch.full((rows,), counter, dtype=torch.int64)
        token = sample(logits, t, any_random=True, any_filter=True, num_logprobs=None).token
        assert allowed.gather(1, token[:, None]).all()


def test_filters_off_leave_rows_untouched():
    logits = _logits(8, seed=6)
    t = _tensors(8, temperature=1.5, seed=3)
    plain = sample(logits, t, any_random=True, any_filter=False, num_logprobs=None).token
    filtered = sample(logits, t, any_random=True, any_filter=True, num_logprobs=None).token
    assert torch.equal(plain, filtered)
    scaled = logits / 1.5
    assert torch.isneginf(_filter_thresholds(scaled, t.top_k, t.top_p)).all()


N_DRAWS = 20_000
PROBS8 = torch.tensor([0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.04, 0.01])
SHUFFLE8 = torch.tensor([3, 6, 0, 7, 2, 5, 1, 4])  # so the best tokens are not the first indices


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampling_matches_the_tempered_distribution(temperature):
    logits = PROBS8.log()[SHUFFLE8]
    tokens = _draws(logits, N_DRAWS, temperature=temperature, seed=11)
    target = (logits / temperature).softmax(-1)
    stat, critical = _chi_square(tokens, target)
    assert stat < critical, (temperature, stat)


def test_top_k_samples_the_renormalised_top_k():
    logits = PROBS8.log()[SHUFFLE8]
    tokens = _draws(logits, N_DRAWS, temperature=1.5, top_k=3, seed=12)
    scaled = logits / 1.5
    keep = scaled >= scaled.topk(3).values[-1]
    assert keep.sum() == 3 and keep[tokens].all()
    target = scaled.masked_fill(~keep, float("-inf")).softmax(-1)
    stat, critical = _chi_square(tokens, target)
    assert stat < critical, stat


def test_top_p_samples_the_renormalised_nucleus():
    logits = PROBS8.log()[SHUFFLE8]
    # mass before each sorted token: 0, .30, .52, .68, .80 -> top_p=0.7 keeps the best four
    tokens = _draws(logits, N_DRAWS, temperature=1.0, top_p=0.7, seed=13)
    keep = torch.zeros(8, dtype=torch.bool)
    keep[SHUFFLE8.argsort()[:4]] = True  # positions of probabilities .30 .22 .16 .12
    assert keep[tokens].all()
    target = logits.masked_fill(~keep, float("-inf")).softmax(-1)
    stat, critical = _chi_square(tokens, target)
    assert stat < critical, stat
    # top-k and top-p together: top_k=5 keeps mass .89; renormalised, the mass before the 4th
    # and 5th tokens is .68/.89 = .76 < 0.8 and .80/.89 = .90 >= 0.8, so the best four remain
    tokens = _draws(logits, N_DRAWS, temperature=1.0, top_k=5, top_p=0.8, seed=14)
    assert set(tokens.tolist()) == set(SHUFFLE8.argsort()[:4].tolist())


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(1, seed=2)[0]
    best = int(logits.argmax())
    assert set(_draws(logits, 300, temperature=5.0, top_k=1).tolist()) == {best}
    assert set(_draws(logits, 300, temperature=5.0, top_p=1e-6).tolist()) == {best}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_of_the_chosen_token_and_the_top_n(temperature):
    logits = _logits(5, seed=2).to(torch.bfloat16)
    t = _tensors(5, temperature=temperature, seed=1)
    out = sample(logits, t, any_random=temperature > 0, any_filter=False, num_logprobs=4)
    full = logits.float().log_softmax(-1)
    assert out.logprob.dtype == torch.float32 and out.top_ids.dtype == torch.int64
    assert torch.allclose(out.logprob, full.gather(1, out.token[:, None]).squeeze(1), atol=1e-6)
    values, ids = full.topk(4)
    assert torch.equal(out.top_ids, ids)
    assert torch.allclose(out.top_logprobs, values, atol=1e-6)
    if temperature == 0.0:
        assert torch.equal(out.token, out.top_ids[:, 0])
    none = sample(logits, t, any_random=temperature > 0, any_filter=False, num_logprobs=None)
    assert torch.equal(none.token, out.token) and none.logprob is None
    zero = sample(logits, t, any_random=temperature > 0, any_filter=False, num_logprobs=0)
    assert torch.equal(zero.logprob, out.logprob)
    assert zero.top_ids.shape == (5, 0) and zero.top_logprobs.shape == (5, 0)


def test_sampling_tensors_for_builds_tensors_and_static_flags():
    params = [SamplingParams(), SamplingParams(logprobs=3)]
    t, any_random, any_filter, n = sampling_tensors_for(params, [1, 2], [0, 5], "cpu")
    assert (any_random, any_filter, n) == (False, False, 3)
    assert t.temperature.tolist() == [0.0, 0.0] and t.counter.tolist() == [0, 5]
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, logprobs=0),
        SamplingParams(top_k=5),  # greedy: its filter does not count
    ]
    t, any_random, any_filter, n = sampling_tensors_for(params, [2**64 - 1, 2**63], [0, 1], "cpu")
    assert (any_random, any_filter, n) == (True, True, 0)
    assert t.seed.tolist() == [-1, -(2**63)] and t.seed.dtype == torch.int64
    assert t.temperature.dtype == torch.float32 and t.top_k.tolist() == [0, 5]
    assert sampling_tensors_for([SamplingParams(temperature=1.0)], [0], [0], "cpu")[1:] == (
        True,
        False,
        None,
    )
    with pytest.raises(ValueError, match="one seed and one counter per row"):
        sampling_tensors_for(params, [1], [0, 1], "cpu")


# --------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_noise_is_bit_identical_and_graph_replay_equals_eager():
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 16, 50_000
    seeds = torch.tensor(EXTREME_SEEDS + list(range(rows - len(EXTREME_SEEDS))), dtype=torch.int64)
    counters = torch.randint(0, 2**62, (rows,), generator=gen)
    assert torch.equal(
        random_words(seeds.cuda(), counters.cuda(), vocab).cpu(),
        random_words(seeds, counters, vocab),
    )
    assert torch.equal(
        uniform_noise(seeds.cuda(), counters.cuda(), vocab).cpu(),
        uniform_noise(seeds, counters, vocab),
    )

    def inputs():
        logits = (torch.randn(rows, vocab, generator=gen) * 3).cuda()
        t = SamplingTensors(
            temperature=(torch.rand(rows, generator=gen) * 2).cuda(),
            top_k=torch.randint(0, 50, (rows,), generator=gen).cuda(),
            top_p=torch.rand(rows, generator=gen).clamp(min=0.05).cuda(),
            seed=torch.randint(0, 2**62, (rows,), generator=gen).cuda(),
            counter=torch.randint(0, 1000, (rows,), generator=gen).cuda(),
        )
        t.temperature[::3] = 0.0
        t.top_p[::2] = 1.0
        return logits, t

    for any_random, any_filter, n in ((False, False, None), (True, False, 0), (True, True, 5)):
        static_logits, static_t = inputs()
        kw = dict(any_random=any_random, any_filter=any_filter, num_logprobs=n)
        torch.cuda.set_sync_debug_mode("error")  # eager: no host synchronisation
        try:
            sample(static_logits, static_t, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            sample(static_logits, static_t, **kw)  # warm up
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = sample(static_logits, static_t, **kw)
        for _ in range(3):
            logits, t = inputs()
            static_logits.copy_(logits)
            for name in ("temperature", "top_k", "top_p", "seed", "counter"):
                getattr(static_t, name).copy_(getattr(t, name))
            graph.replay()
            eager = sample(logits, t, **kw)
            assert torch.equal(static_out.token, eager.token)
            if n is not None:
                assert torch.equal(static_out.logprob, eager.logprob)
                assert torch.equal(static_out.top_ids, eager.top_ids)
            # CUDA samples also equal CPU samples (barring last-ulp log differences on near-ties)
            cpu_t = SamplingTensors(
                *(getattr(t, f).cpu() for f in SamplingTensors.__dataclass_fields__)
            )
            cpu = sample(logits.cpu(), cpu_t, **kw)
            assert (cpu.token == eager.token.cpu()).float().mean() >= 0.9


# -- logit edits: bias and penalties -----------------------------------------------------------


def _seen(prompts: list[list[int]], outputs: list[list[int]], vocab: int = VOCAB) -> torch.Tensor:
    seen = torch.zeros(len(prompts), vocab, dtype=torch.int32)
    for row, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        seen[row, prompt] = 1
        for t in output:
            seen[row, t] += SEEN_OUTPUT
    return seen


def _edits(
    per_row: list[SamplingParams],
    seen: torch.Tensor | None = None,
    vocab: int = VOCAB,
    generated: list[int] | None = None,
    allowed: list[list[int] | None] | None = None,
) -> LogitEdits:
    """The sampler's edits of these rows' params, padded as SlotBatch pads them, drawing the
    tokens of index `generated` (default 0); `allowed`: each row's grammar's tokens (None:
    unconstrained)."""
    rows = len(per_row)
    allowed = allowed or [None] * rows
    words = np.zeros((rows, mask_words(vocab)), dtype=np.uint32)  # bit t % 32 of word t // 32
    for row, tokens in enumerate(allowed):
        for t in tokens or []:
            words[row, t // 32] |= np.uint32(1 << (t % 32))
    stops = [list(p.stop_token_ids or ()) for p in per_row]

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in per_row], dtype=torch.float32)

    pad = [MAX_LOGIT_BIAS - len(p.logit_bias) for p in per_row]
    ids = [[t for t, _ in p.logit_bias] + [0] * n for p, n in zip(per_row, pad, strict=True)]
    values = [[b for _, b in p.logit_bias] + [0.0] * n for p, n in zip(per_row, pad, strict=True)]
    return LogitEdits(
        column("presence_penalty"),
        column("frequency_penalty"),
        column("repetition_penalty"),
        torch.zeros(rows, vocab, dtype=torch.int32) if seen is None else seen,
        torch.tensor(ids),
        torch.tensor(values, dtype=torch.float32),
        torch.tensor([t + [-1] * (MAX_STOP_IDS - len(t)) for t in stops]),
        torch.tensor([p.min_tokens for p in per_row]),
        torch.tensor(generated or [0] * rows),
        torch.tensor([t is not None for t in allowed]),
        torch.from_numpy(words.view(np.int32)),
    )


def test_edits_off_leave_every_logit_bit_for_bit():
    logits = _logits(6, seed=3)
    seen = torch.randint(0, 9, (6, VOCAB), dtype=torch.int32)
    edited = apply_logit_edits(logits, _edits([SamplingParams()] * 6, seen))
    assert torch.equal(edited, logits)


@pytest.mark.parametrize("case", range(40))
def test_edits_agree_with_the_oracles_token_by_token_form(case):
    rng = np.random.default_rng(case)
    rows = 3
    prompts = [list(rng.integers(0, VOCAB, rng.integers(1, 8))) for _ in range(rows)]
    outputs = [list(rng.integers(0, VOCAB, rng.integers(0, 12))) for _ in range(rows)]

    def params() -> SamplingParams:
        presence, frequency = (float(np.float32(x)) for x in rng.uniform(-2, 2, 2))
        biased = rng.choice(VOCAB, rng.integers(0, 5), replace=False)
        return SamplingParams(
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=float(np.float32(rng.uniform(0.3, 2.5))),
            logit_bias={int(t): float(np.float32(rng.uniform(-3, 3))) for t in biased},
            min_tokens=int(rng.integers(0, 14)),
            ignore_eos=True,
            stop_token_ids=[int(t) for t in rng.choice(VOCAB, rng.integers(0, 6), replace=False)],
        )

    per_row = [params() for _ in range(rows)]
    logits = _logits(rows, seed=case) / 4  # near ties: the edits decide
    edits = _edits(per_row, _seen(prompts, outputs), generated=[len(o) for o in outputs])
    got = apply_logit_edits(logits, edits).argmax(-1)
    want = [edited_greedy(logits[r], prompts[r], outputs[r], per_row[r]) for r in range(rows)]
    assert got.tolist() == want


def test_edits_act_as_documented():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seen = torch.tensor([[1, 1, 2 * SEEN_OUTPUT, 0]], dtype=torch.int32)  # prompt, prompt, 2x out

    def edit(**params) -> list[list[float]]:
        return apply_logit_edits(logits, _edits([SamplingParams(**params)], seen, 4)).tolist()

    assert edit(repetition_penalty=2.0) == [[1.0, -4.0, 0.5, 0.5]]  # positive halved, negative x2
    assert edit(presence_penalty=0.5, frequency_penalty=0.25) == [[2.0, -2.0, 0.0, 0.5]]
    assert edit(logit_bias={3: 4.0, 0: -1.0}) == [[1.0, -2.0, 1.0, 4.5]]
    # the bias first, then the penalties: (2 - 1) / 2 for token 0
    assert edit(logit_bias={0: -1.0}, repetition_penalty=2.0)[0][0] == 0.5


def test_min_tokens_holds_back_the_stop_ids_until_enough_tokens_were_drawn():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]] * 3)
    # token 0 is a stop id: the padding's -1 (clamped to token 0) must not undo its -inf
    p = SamplingParams(min_tokens=2, stop_token_ids=[0, 2], logit_bias={0: 100.0})
    edits = _edits([p] * 3, vocab=4, generated=[0, 1, 2])
    got = apply_logit_edits(logits, edits).tolist()
    inf = float("inf")
    assert got[0] == got[1] == [-inf, -2.0, -inf, 0.5]  # tokens 0 and 1 of the output
    assert got[2] == [102.0, -2.0, 1.0, 0.5]  # the third may stop: only the bias remains
    for seed in range(20):  # sampling (filtered too) never draws a held-back stop id
        t = _tensors(3, temperature=2.0, top_p=0.99, seed=seed)
        drawn = sample(logits, t, any_random=True, any_filter=True, num_logprobs=1, edits=edits)
        assert drawn.token[0] in (1, 3) and drawn.token[1] in (1, 3)
        assert drawn.token[2] == 0  # its bias of +100 wins once it may stop
        assert torch.isfinite(drawn.logprob).all()  # the raw logits'


def test_a_grammars_mask_leaves_only_its_tokens():
    """Bit t % 32 of word t // 32 allows token t, bit 31 (a negative word) included; rows
    without a grammar and other edits are untouched."""
    vocab = 70
    logits = _logits(3, seed=5, vocab=vocab)
    keep = [[0, 31, 32, 63, 69], None, [5]]
    p = [SamplingParams(), SamplingParams(logit_bias={3: 1.0}), SamplingParams()]
    edited = apply_logit_edits(logits, _edits(p, vocab=vocab, allowed=keep))
    assert torch.isfinite(edited[0]).nonzero().flatten().tolist() == keep[0]
    assert torch.equal(edited[0, keep[0]], logits[0, keep[0]])
    assert torch.equal(edited[1], apply_logit_edits(logits, _edits(p, vocab=vocab))[1])
    assert torch.isfinite(edited[2]).nonzero().flatten().tolist() == [5]
    for seed in range(10):  # sampling draws only allowed tokens
        t = _tensors(3, temperature=1.5, seed=seed)
        drawn = sample(logits, t, any_random=True, any_filter=False, num_logprobs=None,
                       edits=_edits(p, vocab=vocab, allowed=keep))  # fmt: skip
        assert drawn.token[0] in keep[0] and drawn.token[2] == 5


def test_sample_with_edits_draws_from_the_edited_logits_and_logs_the_raw_ones():
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0], [0.0, 1.0, 2.0, 3.0]])
    seen = torch.tensor([[SEEN_OUTPUT, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.int32)
    edits = _edits(
        [SamplingParams(presence_penalty=2.0), SamplingParams(logit_bias={0: 5.0})], seen, 4
    )
    t = _tensors(2, temperature=0.0)
    out = sample(logits, t, any_random=False, any_filter=False, num_logprobs=1, edits=edits)
    assert out.token.tolist() == [1, 0]  # token 0 lost 2 to presence; row 1's gained 5
    raw = logits.log_softmax(-1)
    assert torch.equal(out.logprob, raw[[0, 1], [1, 0]])
    assert out.top_ids.tolist() == [[0], [3]]  # the raw logits' best
