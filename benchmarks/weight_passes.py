"""How many passes over the weights a steady-state workload costs, counted from the plans
(scheduling only: the counts do not depend on the device, so this runs on the CPU).

A decode traversal reads every weight once; a prefill wave that runs on its own reads them once
per loop; a wave that rides a decode window (worker/decode.py's RidingWave) reads nothing extra.
Tokens per weight pass is what the adaptive-exit gain can reach on a bandwidth-bound GPU.

    python benchmarks/weight_passes.py [--model demo] [--slots 16] [--requests 128]
        [--decode-window 8] [--async-scheduling] [--json]

`--async-scheduling` plans as the GPU default does: window n+1 is planned before window n's
results are seen, so a slot freed in window n is refilled a window later than synchronously.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from rlt_engine import LLM, SamplingParams


def weight_passes(plans: list, depth: int) -> int:
    """Passes over the weights a plan trace costs: one per decode traversal, `depth` per
    prefill wave that runs on its own, none for a wave that rides its window."""
    traversals = sum(p.decode_traversals for p in plans)
    alone = sum(len(p.prefill) - p.wave_rides for p in plans)
    return traversals + depth * alone


def count(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], ride: bool) -> dict:
    engine = llm.engine
    engine.scheduler.ride_waves = ride
    engine.scheduler.trace = []
    outs = llm.generate(prompts, params)
    plans = engine.scheduler.trace
    traversals = sum(p.decode_traversals for p in plans)
    waves = sum(len(p.prefill) for p in plans)
    riding = sum(p.wave_rides for p in plans)
    passes = weight_passes(plans, engine.model_config.num_loops)
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "plans": len(plans),
        "decode_traversals": traversals,
        "prefill_waves": waves,
        "riding_waves": riding,
        "weight_passes": passes,
        "tokens": tokens,
        "tokens_per_pass": tokens / passes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--decode-window", type=int, default=8)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    llm = LLM(
        args.model,
        max_num_seqs=args.slots,
        decode_window=args.decode_window,
        dtype="float32",
        device="cpu",
        async_scheduling=args.async_scheduling,
    )
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    depth = llm.engine.model_config.num_loops
    draw = random.Random(3)
    choices = tuple(range(max(1, depth // 2), depth + 1))
    depths = [draw.choice(choices) for _ in range(args.requests)]
    fixed = [SamplingParams(max_tokens=args.output_len, ignore_eos=True)] * args.requests
    adaptive = [
        SamplingParams(max_tokens=args.output_len, ignore_eos=True, max_loops=d) for d in depths
    ]
    report: dict = {"model": args.model, "slots": args.slots, "requests": args.requests}
    report["decode_window"] = args.decode_window
    report["async_scheduling"] = args.async_scheduling
    report["loop_choices"] = list(choices)
    report["ideal_gain"] = depth / statistics.mean(depths)
    for label, params in (("fixed", fixed), ("adaptive", adaptive)):
        for ride in (False, True):
            report[f"{label}-ride{int(ride)}"] = count(llm, prompts, params, ride)
    for ride in (0, 1):
        gain = (
            report[f"adaptive-ride{ride}"]["tokens_per_pass"]
            / report[f"fixed-ride{ride}"]["tokens_per_pass"]
        )
        report[f"gain-ride{ride}"] = gain
        report[f"share-ride{ride}"] = (gain - 1) / (report["ideal_gain"] - 1)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for key, value in report.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
