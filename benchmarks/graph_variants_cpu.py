"""Which CUDA graph variants a closed-loop workload meets, and when, without a GPU.

The real scheduler runs the workload on the CPU (the tiny test checkpoint, asynchronous
scheduling, waves up to `MAX_GRAPH_ROWS` riding, as on CUDA) and every plan is keyed as the
worker keys its graphs: a decode window by its padded batch and attention launch plan (its
rows attending to fewer than LONG_CONTEXT keys or not, `StepPlan.decode_keys`, as on Triton);
a riding wave by (padded batch, rows bucket, plan); a wave on its own, or each of its pieces,
by its rows bucket. The engine captures all of them at start-up for the flags of default
requests; a variant not captured then (other sampling flags) would be captured the first time a
plan needs it, and every request in flight would wait for that capture. Before 7444e6c start-up
took the short-context plan only: the report counts the long-context variants a workload meets
(`long_context_variants`).
`--jitter J` delays each arrival 0..J steps after the finish that frees its place (clients
over HTTP do not answer in lockstep; with J = 0 the cohorts stay in step and almost no riding
happens).

    python benchmarks/graph_variants_cpu.py -c 64 --num-prompts 1024 --jitter 3

Sampling flags are the defaults' (greedy), as in `rlt bench`. An estimate of what a GPU run
meets: arrival timing there follows the GPU's step times, not the CPU's.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlt_engine.config import EngineConfig  # noqa: E402
from rlt_engine.core.plan import StepPlan  # noqa: E402
from rlt_engine.engine import LLMEngine  # noqa: E402
from rlt_engine.kernels.paged_attention import LONG_CONTEXT  # noqa: E402
from rlt_engine.sampling_params import SamplingParams  # noqa: E402
from rlt_engine.worker.graphs import bucket_sizes  # noqa: E402
from rlt_engine.worker.prefill import CUDA_BUCKETS, MAX_GRAPH_ROWS, WaveLayout  # noqa: E402

TINY = ROOT / "tests" / "fixtures" / "ouro-tiny-official"

Key = tuple[object, ...]


def replay(args: argparse.Namespace) -> list[StepPlan]:
    """The scheduler's plans for `num_prompts` requests, at most `concurrency` in flight."""
    slots = args.max_num_seqs or args.concurrency
    config = EngineConfig.from_options(
        model=str(args.model), device="cpu", dtype="float32", max_num_seqs=slots,
        num_blocks=slots * 4 * ((args.input_len + args.output_len) // 16 + 2),
        async_scheduling=True, decode_window=args.decode_window,
    )  # fmt: skip
    engine = LLMEngine(config)
    engine.scheduler.max_ride_rows = MAX_GRAPH_ROWS  # ModelRunner.max_ride_rows on CUDA
    engine.scheduler.trace = []
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    added = 0

    def add() -> None:
        nonlocal added
        engine.add_request([rng.randrange(3, 4000) for _ in range(args.input_len)], params)
        added += 1

    for _ in range(min(args.concurrency, args.num_prompts)):
        add()
    due: collections.Counter[int] = collections.Counter()  # step -> arrivals
    step = 0
    while engine.has_unfinished_requests() or due:
        for _ in range(due.pop(step, 0)):
            add()
        for out in engine.step():
            if out.finished and added + sum(due.values()) < args.num_prompts:
                due[step + 1 + rng.randrange(args.jitter + 1)] += 1
        step += 1
    return engine.scheduler.trace


def plan_keys(plan: StepPlan, span: int, num_slots: int, long: bool) -> list[Key]:
    """The graph variants `plan` replays; `span`: slots [0, span) in use once it is applied;
    `long`: its window's rows may attend to LONG_CONTEXT keys."""
    padded = next((b for b in bucket_sizes(num_slots) if b >= span), None)
    if plan.wave_rides:
        wave = WaveLayout.of(plan.prefill[0])
        rows = CUDA_BUCKETS.of(wave, num_slots)
        if rows is None:  # too many chunks for any bucket: rides eagerly, no graph
            return []
        return [("ride", padded, rows, long)]
    keys: list[Key] = []
    max_chunks = CUDA_BUCKETS.seqs(MAX_GRAPH_ROWS, num_slots) - 1
    for chunks in plan.prefill:
        wave = WaveLayout.of(chunks)
        pieces = wave.pieces(MAX_GRAPH_ROWS, max_chunks)
        buckets = [CUDA_BUCKETS.of(p, num_slots) for p in pieces]
        keys += [("prefill", rows) for rows in buckets if rows is not None]  # else exact
    if plan.decode_traversals and padded is not None:
        keys.append(("decode", padded, long))
    return keys


def variants(plans: list[StepPlan], num_slots: int) -> dict:
    """Each variant met: how often, the first plan that needs it, captured at start-up or not."""
    # as ModelRunner.capture_graphs on Triton (startup_flags: both attention launch plans)
    batches, rows_buckets, longs = bucket_sizes(num_slots), CUDA_BUCKETS.rows, (False, True)
    at_start: set[Key] = {("decode", b, long) for b in batches for long in longs}
    at_start |= {("prefill", rows) for rows in rows_buckets}
    at_start |= {("ride", b, r, long) for b in batches for r in rows_buckets for long in longs}
    used: set[int] = set()
    met: dict[Key, dict] = {}
    for i, plan in enumerate(plans):
        used.difference_update(plan.slot_frees)
        used.update(init.slot for init in plan.slot_inits)
        span, long = max(used, default=-1) + 1, plan.decode_keys >= LONG_CONTEXT
        for key in plan_keys(plan, span, num_slots, long):
            entry = met.setdefault(key, {"first_plan": i, "uses": 0, "at_start": key in at_start})
            entry["uses"] += 1
    first_use = sorted((v["first_plan"], k) for k, v in met.items() if not v["at_start"])
    return {
        "plans": len(plans),
        "riding_plans": sum(p.wave_rides for p in plans),
        "variants": [{"key": list(k), **v} for k, v in met.items()],
        "long_context_variants": sum(k[0] != "prefill" and k[-1] for k in met),
        "first_use": [{"plan": i, "key": list(k)} for i, k in first_use],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=TINY)
    ap.add_argument("-c", "--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="slots (default: -c)")
    ap.add_argument("--decode-window", type=int, default=8)
    ap.add_argument("--jitter", type=int, default=3, help="arrival delay, 0..J steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for name in ("concurrency", "num_prompts", "input_len", "output_len", "decode_window"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.jitter < 0:
        ap.error("--jitter must be >= 0")
    num_slots = args.max_num_seqs or args.concurrency
    report = {"settings": {k: str(v) for k, v in vars(args).items()}}
    report |= variants(replay(args), num_slots)
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"{report['plans']} plans, {report['riding_plans']} with a riding wave, "
        f"{len(report['variants'])} graph variants met, {len(report['first_use'])} of them "
        "not captured at start-up (each a stall for the requests in flight); "
        f"{report['long_context_variants']} with contexts past {LONG_CONTEXT} keys "
        "(captured on first use before 7444e6c):"
    )
    for entry in report["first_use"]:
        print(f"  plan {entry['plan']:>5}: {tuple(entry['key'])}")


if __name__ == "__main__":
    main()
