"""rlt_engine/bench/throughput.py on the CPU with the bundled checkpoint: the DESIGN section 9
rate and the tokens committed while its clock runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlt_engine import LLM
from rlt_engine.bench.throughput import benchmark

BUNDLED = Path(__file__).resolve().parents[2] / "rlt_engine" / "assets" / "ouro-gsm8k-tiny"


def test_window_tokens_count_only_what_the_clock_saw():
    engine = LLM(str(BUNDLED), device="cpu", max_num_seqs=64).engine
    few = benchmark(engine, 2, prompt_len=8, output_len=6, repeats=1, warmup=0)
    many = benchmark(engine, 64, prompt_len=64, output_len=8, repeats=1, warmup=0)
    for r, c, n in ((few, 2, 6), (many, 64, 8)):
        run = r["runs"][0]
        assert 0 < run["window_tokens"] <= (n - 1) * c
        assert run["window_tokens_per_s"] * run["decode_seconds"] == pytest.approx(
            run["window_tokens"]
        )
        assert r["window_tokens_per_s_median"] <= r["decode_tokens_per_s_median"]
    # 64 prompts of 64 tokens take several prefill steps on the CPU: the requests prefilled
    # first have decoded by the time the last one has its first token, which the formula's
    # (output_len - 1) x concurrency still counts
    assert many["runs"][0]["window_tokens"] < 7 * 64
