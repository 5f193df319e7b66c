"""The `rlt bench --url` workload without HTTP: the same prompts, arrivals and concurrency
limit, sent straight to the AsyncEngine that `rlt serve` runs (its engine thread, its command
queue, its per-request asyncio streams), timed the same way (`bench/serving.py`'s RequestResult
and summarize). Served / in-process is the cost of the HTTP path itself; in-process / offline
`rlt bench` is the cost of requests arriving one by one instead of in lockstep.

    python benchmarks/bench_serving_inprocess.py --model tests/fixtures/ouro-1.4b \
        --load-format dummy --max-num-seqs 256 --runs c8:64,c1:8,c64:512 --json

Each run is `cC:N` (N requests, at most C in flight, all sent at once) or `rR:N` (N requests,
Poisson arrivals at R requests/s); a warm-up run (64 requests at c=64, not reported) captures the
CUDA graphs first (`--warmup N` to change its size). `--engine-process` runs the engine in a
process of its own, as `rlt serve` does; without it, on a thread of this one.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlt_engine.async_engine import AsyncEngine  # noqa: E402
from rlt_engine.bench.serving import (  # noqa: E402
    RequestResult,
    arrival_offsets,
    chunk_latencies,
    random_prompts,
    summarize,
)
from rlt_engine.config import EngineConfig  # noqa: E402
from rlt_engine.engine import LLMEngine  # noqa: E402
from rlt_engine.sampling_params import SamplingParams  # noqa: E402


def parse_run(text: str) -> tuple[str, float, int]:
    """'c8:64' -> ('c', 8, 64); 'r16:48' -> ('r', 16.0, 48)."""
    kind, _, rest = text.partition(":")
    if kind[:1] not in ("c", "r") or not rest:
        raise argparse.ArgumentTypeError(f"a run is cC:N or rR:N, got {text!r}")
    return kind[0], float(kind[1:]), int(rest)


async def one_request(
    engine: AsyncEngine, rid: str, prompt: list[int], output_len: int, t0: float
) -> RequestResult:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    chunks: list[tuple[float, int]] = []
    try:
        async for out in engine.generate(prompt, params, rid):
            if out.new_token_ids:
                chunks.append((time.perf_counter(), len(out.new_token_ids)))
    except Exception as exc:  # a failed request is a result, as over HTTP
        return RequestResult(ok=False, start_s=start - t0, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    ttft, itl = chunk_latencies(start, chunks)
    tokens = sum(k for _, k in chunks)
    return RequestResult(
        ok=ttft is not None,
        start_s=start - t0,
        ttft_s=ttft,
        itl_s=itl,
        e2e_s=end - start,
        output_tokens=tokens,
        prompt_tokens=len(prompt),
        chunks=len(chunks),
        error=None if ttft is not None else "no tokens",
    )


async def run(
    engine: AsyncEngine, label: str, kind: str, value: float, n: int, args: argparse.Namespace
) -> dict:
    prompts = random_prompts(n, args.input_len, args.seed)
    rate = value if kind == "r" else math.inf
    offsets = arrival_offsets(n, rate, args.seed)
    limit = asyncio.Semaphore(int(value)) if kind == "c" else None
    t0 = time.perf_counter()

    async def one(i: int) -> RequestResult:
        delay = t0 + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is None:
            return await one_request(engine, f"{label}-{i}", prompts[i], args.output_len, t0)
        async with limit:
            return await one_request(engine, f"{label}-{i}", prompts[i], args.output_len, t0)

    results = await asyncio.gather(*(one(i) for i in range(n)))
    return {"run": label, "num_prompts": n, **summarize(results, time.perf_counter() - t0)}


async def main_async(args: argparse.Namespace) -> list[dict]:
    options = {"model": args.model, "max_num_seqs": args.max_num_seqs}
    for name in ("load_format", "device", "dtype", "decode_window"):
        if getattr(args, name):
            options[name] = getattr(args, name)
    config = EngineConfig.from_options(**options)
    engine = AsyncEngine(functools.partial(LLMEngine, config), engine_process=args.engine_process)
    engine.start()
    if not engine.wait_ready():
        raise SystemExit(f"the engine failed to start: {engine.error}")
    try:
        if args.warmup:
            await run(engine, "warmup", "c", 64, args.warmup, args)
        reports = []
        for kind, value, n in args.runs:
            label = f"{kind}{value:g}"
            report = await run(engine, label, kind, value, n, args)
            reports.append(report)
            if not args.json:
                print(
                    f"{label} {report['completed']} ok {report['failed']} failed "
                    f"{report['output_throughput']:.1f} out tok/s, ttft p50 "
                    f"{report['ttft_ms']['median']:.1f} ms, tpot p50 "
                    f"{report['tpot_ms']['median']:.2f} ms",
                    flush=True,
                )
        return reports
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--decode-window", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--runs", type=lambda s: [parse_run(x) for x in s.split(",")], required=True)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=64, help="requests of the unreported warm-up")
    ap.add_argument("--json", action="store_true", help="one JSON report per line")
    ap.add_argument(
        "--engine-process",
        action="store_true",
        help="run the engine in a process of its own, as `rlt serve` does (default: a thread)",
    )
    args = ap.parse_args()
    reports = asyncio.run(main_async(args))
    if args.json:
        for report in reports:
            print(json.dumps(report))


if __name__ == "__main__":
    main()
