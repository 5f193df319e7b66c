"""Eager decode baseline (DESIGN §9 workload): full-size model, dummy weights, fixed depth.

    python benchmarks/bench_decode.py --model ouro --load-format dummy --concurrency 1 8 \
        --out benchmarks/results/decode.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from rlt_engine import LLM
from rlt_engine.bench.throughput import benchmark


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="ouro")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    llm = LLM(
        args.model, load_format=args.load_format, dtype=args.dtype, num_blocks=args.num_blocks
    )
    engine = llm.engine
    results = {
        "model": args.model,
        "load_format": args.load_format,
        "dtype": str(engine.dtype),
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "backend": "torch (eager)",
        "num_blocks": engine.num_blocks,
        "results": [],
    }
    for c in args.concurrency:
        r = benchmark(engine, c, args.prompt_len, args.output_len, args.repeats)
        print(
            f"c={c}: {r['decode_tokens_per_s_median']:.1f} tok/s decode, "
            f"TTFT {r['ttft_ms_median']:.1f} ms, TPOT {r['tpot_ms_median']:.2f} ms",
            flush=True,
        )
        results["results"].append(r)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
