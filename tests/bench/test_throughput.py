"""rlt_engine/bench/throughput.py on the CPU with the bundled checkpoint: the DESIGN section 9
rate and the tokens committed while its clock runs."""

from __future__ import annotations

import time
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


def test_the_decode_clock_holds_every_decode_window(monkeypatch):
    """The clock starts at the last first token, not after the device has drained: with
    asynchronous scheduling the step that hands out the first tokens has already queued the
    first decode window behind them, and a device sync there (before 2026-12-06) started the
    clock after that window while still counting its tokens (~6% high at c=1 with 32
    outputs). A device is played on the CPU: each launched decode window takes WINDOW_S of
    device time, in launch order; collecting a plan waits for its end, a sync for the last."""
    from rlt_engine.bench import throughput

    window_s = 0.04
    engine = LLM(str(BUNDLED), device="cpu", async_scheduling=True, decode_window=4).engine
    runner, device_free, ends = engine.runner, [0.0], {}
    launch, collect = runner.launch, runner.collect

    def timed_launch(plan):  # type: ignore[no-untyped-def]
        launched = launch(plan)
        start = max(time.perf_counter(), device_free[0])
        device_free[0] = start + (window_s if plan.decode_traversals else 0.0)
        ends[id(launched)] = device_free[0]
        return launched

    def timed_collect(launched):  # type: ignore[no-untyped-def]
        time.sleep(max(0.0, ends.pop(id(launched)) - time.perf_counter()))
        return collect(launched)

    def timed_sync(device):  # type: ignore[no-untyped-def]
        time.sleep(max(0.0, device_free[0] - time.perf_counter()))

    monkeypatch.setattr(runner, "launch", timed_launch)
    monkeypatch.setattr(runner, "collect", timed_collect)
    monkeypatch.setattr(throughput, "_sync", timed_sync)
    windows = []
    real_schedule = engine.scheduler.schedule

    def counting_schedule():  # type: ignore[no-untyped-def]
        plan = real_schedule()
        if plan is not None and plan.decode_traversals:
            windows.append(plan)
        return plan

    monkeypatch.setattr(engine.scheduler, "schedule", counting_schedule)
    run = throughput.run_once(engine, 1, prompt_len=8, output_len=9)
    # 8 tokens after the first, 4 traversals each at fixed depth 4 in windows of 4: 8 windows
    # of device time, every one of them inside the clock
    assert len(windows) >= 8
    assert run.decode_seconds >= len(windows) * window_s * 0.98
