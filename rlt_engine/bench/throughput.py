"""Offline decode benchmark on an `LLMEngine`: committed decode tokens/s (below).

Committed decode tokens/s = (output_len - 1) x concurrency / decode seconds, where decode time
runs from the moment every request has its first token to the last completion (DESIGN section
9). Prefill, the first token and HTTP are excluded. The clock starts when the step that hands
out the last first token returns, without a device sync: the host has just waited for those
tokens' read back, and under asynchronous scheduling that step has already queued the first
decode window, which a sync would wait for while its tokens still count
(`benchmarks/results/2026-12-06-decode-clock-cpu.md`). It stops after a device sync once the
last request has finished.
That formula assumes each request has exactly its first token when the clock starts; where
prefill takes several steps (high concurrency, small token budgets) the requests prefilled
first have decoded more by then, and it counts those tokens too. So each run also reports the
tokens committed while the clock ran (`window_tokens`) and their rate. Per-request latency
(TTFT, TPOT, E2E) percentiles, the exit-depth histogram of every output token and, on CUDA, the
peak memory allocated while the runs of one concurrency were going come with it.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from rlt_engine.bench.stats import percentile
from rlt_engine.engine import LLMEngine
from rlt_engine.sampling_params import SamplingParams


@dataclass
class DecodeRun:
    concurrency: int
    prompt_len: int
    output_len: int
    decode_seconds: float
    decode_tokens_per_s: float
    ttft_ms: list[float]
    tpot_ms: float  # decode seconds per committed token of one request
    steps: int
    e2e_ms: list[float] = field(default_factory=list)  # arrival to finish, per request
    request_tpot_ms: list[float] = field(default_factory=list)  # (finish - first) / (n - 1)
    exit_depths: dict[int, int] = field(default_factory=dict)  # loops run -> output tokens
    # output tokens committed while the decode clock ran (the formula's count is
    # (output_len - 1) x concurrency) and their rate
    window_tokens: int = 0
    window_tokens_per_s: float = 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(
    engine: LLMEngine,
    concurrency: int,
    prompt_len: int,
    output_len: int,
    params: SamplingParams | None = None,
    seed: int = 0,
) -> DecodeRun:
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = params or SamplingParams(max_tokens=output_len, ignore_eos=True)
    _sync(engine.device)
    ids = [
        engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), params)
        for _ in range(concurrency)
    ]
    steps, t_decode, at_start = 0, None, 0
    done: dict[str, object] = {}
    counts: dict[str, int] = {}  # request -> output tokens so far
    while len(done) < len(ids):
        for out in engine.step():
            counts[out.request_id] = out.num_tokens
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if t_decode is None and len(counts) == len(ids) and all(counts.values()):
            t_decode = time.perf_counter()  # no sync: see the module docstring
            at_start = sum(counts.values())
    _sync(engine.device)
    decode_s = time.perf_counter() - (t_decode or time.perf_counter())
    outs = [done[i] for i in ids]
    ttft = [1e3 * (o.metrics.first_token_time - o.metrics.arrival_time) for o in outs]  # type: ignore[attr-defined]
    e2e = [1e3 * (o.metrics.finish_time - o.metrics.arrival_time) for o in outs]  # type: ignore[attr-defined]
    request_tpot = [
        1e3
        * (o.metrics.finish_time - o.metrics.first_token_time)  # type: ignore[attr-defined]
        / max(1, len(o.token_ids) - 1)  # type: ignore[attr-defined]
        for o in outs
    ]
    depths = Counter(d for o in outs for d in o.exit_depths)  # type: ignore[attr-defined]
    return DecodeRun(
        concurrency=concurrency,
        prompt_len=prompt_len,
        output_len=output_len,
        decode_seconds=decode_s,
        decode_tokens_per_s=(output_len - 1) * concurrency / decode_s if decode_s > 0 else 0.0,
        ttft_ms=ttft,
        tpot_ms=1e3 * decode_s / max(1, output_len - 1),
        steps=steps,
        e2e_ms=e2e,
        request_tpot_ms=request_tpot,
        exit_depths=dict(sorted(depths.items())),
        window_tokens=output_len * concurrency - at_start,
        window_tokens_per_s=(output_len * concurrency - at_start) / decode_s
        if decode_s > 0
        else 0.0,
    )


def benchmark(
    engine: LLMEngine,
    concurrency: int,
    prompt_len: int = 64,
    output_len: int = 32,
    repeats: int = 3,
    warmup: int = 1,
    params: SamplingParams | None = None,
    on_run: Callable[[str, int, int], None] | None = None,
    seed: int = 0,
) -> dict:
    """Median over `repeats` runs after `warmup` discarded runs.

    `params` sets the rest of each request (loop controls, sampling); max_tokens is always
    `output_len` and ignore_eos is always on, so every request yields exactly `output_len`
    tokens. `on_run(phase, i, n)` ("warmup" or "run", 1-based) is called before each run.
    Run i draws its random prompts from `seed + i` (warmup runs from `seed + 1000 + i`).
    """
    params = replace(params or SamplingParams(), max_tokens=output_len, ignore_eos=True)
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
    start_bytes = torch.cuda.memory_allocated(engine.device) if cuda else None
    for i in range(warmup):
        if on_run is not None:
            on_run("warmup", i + 1, warmup)
        run_once(engine, concurrency, prompt_len, output_len, params, seed=seed + 1000 + i)
    before = engine.stats()
    runs = []
    for i in range(repeats):
        if on_run is not None:
            on_run("run", i + 1, repeats)
        runs.append(run_once(engine, concurrency, prompt_len, output_len, params, seed=seed + i))
    peak_bytes = torch.cuda.max_memory_allocated(engine.device) if cuda else None
    after = engine.stats()  # graphs captured while measuring: their stalls are in the numbers
    rates = [r.decode_tokens_per_s for r in runs]
    ttfts = [t for r in runs for t in r.ttft_ms]
    e2es = [t for r in runs for t in r.e2e_ms]
    tpots = [t for r in runs for t in r.request_tpot_ms]
    depths: Counter[int] = Counter()
    for r in runs:
        depths.update(r.exit_depths)
    return {
        "concurrency": concurrency,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "repeats": repeats,
        "decode_tokens_per_s_median": statistics.median(rates),
        "decode_tokens_per_s_all": rates,
        "window_tokens_per_s_median": statistics.median(r.window_tokens_per_s for r in runs),
        "window_tokens_median": statistics.median(r.window_tokens for r in runs),
        "ttft_ms_median": statistics.median(ttfts),
        "tpot_ms_median": statistics.median(r.tpot_ms for r in runs),
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p90": percentile(ttfts, 90),
        "tpot_ms_p50": percentile(tpots, 50),
        "e2e_ms_p50": percentile(e2es, 50),
        "exit_depths": dict(sorted(depths.items())),
        "steps_per_run": runs[0].steps,
        "graphs_captured_in_runs": after.graphs_captured - before.graphs_captured,
        "graph_capture_s_in_runs": after.graph_capture_s - before.graph_capture_s,
        # CUDA only (None on CPU): bytes allocated at the start (weights, KV pool, buffers) and
        # the peak over warm-up and measured runs (reset per call)
        "memory_start_bytes": start_bytes,
        "peak_memory_bytes": peak_bytes,
        "runs": [asdict(r) for r in runs],
    }
