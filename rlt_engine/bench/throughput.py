"""Offline decode benchmark on an `LLMEngine` (the DESIGN §9 metric).

Committed decode tokens/s = (output_len - 1) x concurrency / decode seconds, where decode time
runs from the moment every request has its first token to the last completion, with the device
synchronized at both ends. Prefill, the first token and HTTP are excluded.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

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
    started: set[str] = set()
    steps, t_decode = 0, None
    done: dict[str, object] = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.token_ids:
                started.add(out.request_id)
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if t_decode is None and len(started) == len(ids):
            _sync(engine.device)
            t_decode = time.perf_counter()
    _sync(engine.device)
    decode_s = time.perf_counter() - (t_decode or time.perf_counter())
    outs = [done[i] for i in ids]
    ttft = [1e3 * (o.metrics.first_token_time - o.metrics.arrival_time) for o in outs]  # type: ignore[attr-defined]
    return DecodeRun(
        concurrency=concurrency,
        prompt_len=prompt_len,
        output_len=output_len,
        decode_seconds=decode_s,
        decode_tokens_per_s=(output_len - 1) * concurrency / decode_s if decode_s > 0 else 0.0,
        ttft_ms=ttft,
        tpot_ms=1e3 * decode_s / max(1, output_len - 1),
        steps=steps,
    )


def benchmark(
    engine: LLMEngine,
    concurrency: int,
    prompt_len: int = 64,
    output_len: int = 32,
    repeats: int = 3,
    warmup: int = 1,
) -> dict:
    """Median over `repeats` runs after `warmup` discarded runs."""
    for i in range(warmup):
        run_once(engine, concurrency, prompt_len, output_len, seed=1000 + i)
    runs = [run_once(engine, concurrency, prompt_len, output_len, seed=i) for i in range(repeats)]
    rates = [r.decode_tokens_per_s for r in runs]
    ttfts = [t for r in runs for t in r.ttft_ms]
    return {
        "concurrency": concurrency,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "repeats": repeats,
        "decode_tokens_per_s_median": statistics.median(rates),
        "decode_tokens_per_s_all": rates,
        "ttft_ms_median": statistics.median(ttfts),
        "tpot_ms_median": statistics.median(r.tpot_ms for r in runs),
        "steps_per_run": runs[0].steps,
        "runs": [asdict(r) for r in runs],
    }
