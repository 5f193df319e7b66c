"""benchmarks/h200_decode.py's committed decode rate, on the CPU with the bundled checkpoint:
it counts the tokens committed after every request's first one, no more."""

from __future__ import annotations

from pathlib import Path

import benchmark_scripts

from rlt_engine import LLM, SamplingParams

BUNDLED = Path(__file__).resolve().parents[2] / "rlt_engine" / "assets" / "ouro-gsm8k-tiny"


def test_decode_rate_counts_the_tokens_after_the_first(monkeypatch):
    monkeypatch.syspath_prepend(str(benchmark_scripts.ROOT / "benchmarks"))  # weight_passes
    bench = benchmark_scripts.load("h200_decode")
    llm = LLM(str(BUNDLED), device="cpu", max_num_seqs=4)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 9, 4)]
    rate = bench.decode_rate(llm, prompts, params)
    # every request's tokens but those already out when the last first token arrived (at
    # least its first), so at most 5 + 8 + 3 (every token, 19, before the fix)
    assert 0 < rate["committed"] <= 16
    assert rate["decode_tok_s"] > 0


def test_lockstep_cohorts_take_equal_traversals_and_the_equal_context_one_equal_contexts(
    monkeypatch,
):
    monkeypatch.syspath_prepend(str(benchmark_scripts.ROOT / "benchmarks"))
    bench = benchmark_scripts.load("h200_decode")
    cohorts = bench._lockstep(64)
    depths, tokens = cohorts["depths"], cohorts["tokens"]
    assert set(depths) == {2, 3, 4}
    assert all(120 < n * d <= 128 for n, d in zip(tokens, depths, strict=True))
    fixed_prompts, fixed = cohorts["fixed"]
    same, adapt = cohorts["adaptive"]
    cut, adapt_cut = cohorts["adaptive_equal_context"]
    assert same is fixed_prompts and adapt_cut is adapt
    assert all(p.max_tokens == 33 and p.max_loops is None for p in fixed)
    for full, short, n, p in zip(fixed_prompts, cut, tokens, adapt, strict=True):
        assert short == full[: len(short)] and p.max_tokens == n + 1
        # a request's mean context over its decode: the fixed cohort's 64 + 32 / 2
        assert abs(len(short) + n / 2 - 80) <= 0.5
