"""Device-resident decode on a GPU: exactness across modes, then the DESIGN §9 benchmarks.

    python benchmarks/h200_decode.py --out $OUT            # everything
    python benchmarks/h200_decode.py --only bench --out X  # one part

Parts (each writes <part>.json under --out):
- exact:   fp32, the official-code golden checkpoint at every depth and a gated tiny Ouro with
           adaptive exits: torch eager = triton eager = triton graphs = CPU (tokens and depths).
- agree:   Ouro-1.4B dummy bf16: token agreement of triton+graphs with the eager torch path.
- bench:   committed decode tok/s (DESIGN §9: from every request's first token to the last
           completion), 64-token prompts, 32 outputs, fixed depth, c = 1/8/64/256, plus eager,
           window sizes, adaptive exit (max_loops drawn from {2,3,4}), 1k prompts, Nanbeige.
- adaptive: steady-state gain of per-request max_loops from {2,3,4}, 8x as many requests as
           slots (refills and prefill between windows included in the traffic).
- adaptive_lockstep: the decode path's gain alone (one cohort, equal traversals per request).
- profile: torch.profiler over decode at c=8: GPU-busy share of the decode wall time.
- profile_lockstep: adaptive_lockstep's cohorts under torch.profiler: kernel time per
           traversal, fixed against adaptive (what early exits add).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from weight_passes import weight_passes  # noqa: E402  (benchmarks/, the script's directory)

from rlt_engine import LLM, SamplingParams  # noqa: E402
from rlt_engine.bench.throughput import _sync  # noqa: E402

OURO = ROOT / "tests" / "fixtures" / "ouro-1.4b"
NANBEIGE = ROOT / "tests" / "fixtures" / "nanbeige4.2-3b"


def _outs(llm: LLM, prompts, params) -> list:
    return [(o.token_ids, o.exit_depths) for o in llm.generate(prompts, params)]


def exact(tmp: Path) -> dict:
    import golden
    import tiny_checkpoints

    modes = {
        "cpu-torch": dict(device="cpu", attention_backend="torch"),
        "cuda-torch-eager": dict(device="cuda", attention_backend="torch"),
        "cuda-triton-eager": dict(device="cuda", attention_backend="triton", enforce_eager=True),
        "cuda-triton-graphs": dict(device="cuda", attention_backend="triton"),
        "cuda-triton-graphs-w3": dict(device="cuda", attention_backend="triton", decode_window=3),
        # CUDA defaults to async scheduling: the modes above are async, this one is not
        "cuda-triton-graphs-sync": dict(
            device="cuda", attention_backend="triton", async_scheduling=False
        ),
    }
    report: dict = {"golden": {}, "adaptive": {}}
    for depth in range(1, golden.DEPTH + 1):
        path = golden.golden_dir(tmp, depth)
        p = SamplingParams(max_tokens=golden.new_tokens(), ignore_eos=True)
        for name, opts in modes.items():
            llm = LLM(str(path), dtype="float32", block_size=4, num_blocks=256, **opts)
            got = [t for t, _ in _outs(llm, golden.prompts(), p)]
            report["golden"][f"d{depth}-{name}"] = got == golden.greedy(depth)
    ckpt = tiny_checkpoints.write_tiny_ouro(tmp / "tiny", tokenizer_from=None)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 3, 5, 8, 13, 21)]
    for th in (1.0, 0.6, 0.3):
        params = [
            SamplingParams(max_tokens=12, ignore_eos=True, exit_threshold=th, max_loops=m)
            for m in (4, 3, 4, 2, 4, 4)
        ]
        want = None
        for name, opts in modes.items():
            llm = LLM(str(ckpt), dtype="float32", block_size=4, num_blocks=512, **opts)
            got = _outs(llm, prompts, params)
            want = want or got
            report["adaptive"][f"t{th}-{name}"] = got == want
    report["all_exact"] = all(report["golden"].values()) and all(report["adaptive"].values())
    return report


def _engine(model: Path, **opts) -> LLM:
    import gc

    gc.collect()  # engines dropped earlier hold the pool until collected (graph cycles)
    torch.cuda.empty_cache()
    return LLM(str(model), load_format="dummy", dtype="bfloat16", device="cuda", **opts)


def agree() -> dict:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49152) for _ in range(64)] for _ in range(8)]
    p = SamplingParams(max_tokens=32, ignore_eos=True)
    ref = _outs(_engine(OURO, attention_backend="torch", max_num_seqs=8), prompts, p)
    fast = _outs(_engine(OURO, attention_backend="triton", max_num_seqs=8), prompts, p)
    same = sum(
        a == b for (x, _), (y, _) in zip(ref, fast, strict=True) for a, b in zip(x, y, strict=True)
    )
    prefix = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
        for (x, _), (y, _) in zip(ref, fast, strict=True)
    ]
    return {"tokens": 8 * 32, "same_position": same, "first_divergence": prefix}


def decode_rate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Committed decode tok/s: from every request's first token to the last completion, the
    tokens committed in between (`num_tokens`: an unfinished output's `token_ids` is empty)."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, request_id=f"b{i}")
    t0 = time.perf_counter()
    first, tokens, done = {}, {}, 0
    start = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter())
            tokens[out.request_id] = out.num_tokens
            done += out.finished
        if start is None and len(first) == len(prompts):
            # no sync: the step has already queued the first decode window behind the first
            # tokens (rlt_engine/bench/throughput.py says why)
            start = time.perf_counter()
            at_start = sum(tokens.values())
    _sync(engine.device)
    end = time.perf_counter()
    committed = sum(tokens.values()) - at_start
    return {
        "decode_tok_s": committed / (end - start) if end > start else float("nan"),
        "committed": committed,
        "ttft_ms_max": (max(first.values()) - t0) * 1e3,
        "e2e_s": end - t0,
    }


def _workload(c: int, prompt_len: int, out_len: int, seed: int = 2, max_loops=None):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 49152) for _ in range(prompt_len)] for _ in range(c)]
    params = [
        SamplingParams(
            max_tokens=out_len,
            ignore_eos=True,
            max_loops=None if max_loops is None else max_loops(i),
        )
        for i in range(c)
    ]
    return prompts, params


def _median_rate(llm: LLM, c: int, prompt_len=64, out_len=32, repeats=3, max_loops=None) -> dict:
    prompts, params = _workload(c, prompt_len, out_len, max_loops=max_loops)
    decode_rate(llm, prompts, params)  # warm-up: graphs captured, kernels compiled
    runs = [decode_rate(llm, prompts, params) for _ in range(repeats)]
    rates = [r["decode_tok_s"] for r in runs]
    return {
        "concurrency": c,
        "prompt_len": prompt_len,
        "output_len": out_len,
        "decode_tok_s_median": statistics.median(rates),
        "decode_tok_s_runs": rates,
        "ttft_ms_max_median": statistics.median(r["ttft_ms_max"] for r in runs),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def bench() -> dict:
    rows = []

    def run(label: str, llm: LLM, cs, **kw):
        for c in cs:
            torch.cuda.reset_peak_memory_stats()
            r = {"config": label, **_median_rate(llm, c, **kw)}
            print(json.dumps(r), flush=True)
            rows.append(r)

    big = _engine(OURO, max_num_seqs=256, gpu_memory_utilization=0.85)
    run("triton+graphs w8", big, (1, 8, 64, 256))
    draw = random.Random(3)
    depths = [draw.choice((2, 3, 4)) for _ in range(256)]
    run("adaptive max_loops~{2,3,4} w8", big, (8, 64), max_loops=lambda i: depths[i])
    run("triton+graphs w8 1k prompts", big, (1, 32), prompt_len=1024)
    del big
    torch.cuda.empty_cache()
    for window in (4, 16):
        llm = _engine(OURO, max_num_seqs=8, decode_window=window)
        run(f"triton+graphs w{window}", llm, (8,))
        del llm
    llm = _engine(OURO, max_num_seqs=8, enforce_eager=True)
    run("triton eager w8", llm, (1, 8), repeats=1)
    del llm
    torch.cuda.empty_cache()
    llm = _engine(NANBEIGE, max_num_seqs=8)
    run("nanbeige triton+graphs w8", llm, (8,))
    return {"rows": rows}


def adaptive() -> dict:
    """Adaptive-exit gain in steady state: 8x as many requests as slots (a finished slot is
    refilled as soon as it is free), per-request max_loops drawn from {2,3,4} against fixed
    depth 4. Rate = tokens emitted by decode-only steps / their wall time (prefill steps
    excluded). Also, whole runs: the schedule's own gain in weight passes (prefill included:
    `weight_passes.py`'s count of the plans that ran) and the share of it the GPU realised
    in end-to-end time (the same tokens either way)."""
    draw = random.Random(3)
    depths = [draw.choice((2, 3, 4)) for _ in range(64)]
    report = {}
    for slots in (8, 64):
        llm = _engine(OURO, max_num_seqs=slots)
        n = 8 * slots
        for label, max_loops in (("fixed", None), ("adaptive", lambda i: depths[i % 64])):
            prompts, params = _workload(n, 64, 32, max_loops=max_loops)
            _steady(llm, prompts, params)  # warm-up
            report[f"{label}-slots{slots}"] = _steady(llm, prompts, params)
        fixed, adapt = report[f"fixed-slots{slots}"], report[f"adaptive-slots{slots}"]
        mean_loops = statistics.mean(depths)
        theory = 4 / mean_loops
        gain = adapt["decode_tok_s"] / fixed["decode_tok_s"]
        full_gain = adapt["full_occupancy_tok_s"] / fixed["full_occupancy_tok_s"]
        scheduled = fixed["weight_passes"] / adapt["weight_passes"]
        e2e = fixed["e2e_s"] / adapt["e2e_s"]
        report[f"slots{slots}"] = {
            "theoretical_gain": theory,
            "measured_gain": gain,
            "share_of_loop_savings": (gain - 1) / (theory - 1),
            "full_occupancy_gain": full_gain,
            "full_occupancy_share": (full_gain - 1) / (theory - 1),
            "scheduled_gain": scheduled,
            "e2e_gain": e2e,
            "share_of_scheduled_gain": (e2e - 1) / (scheduled - 1) if scheduled != 1 else None,
        }
        del llm
        torch.cuda.empty_cache()
    return report


# `_lockstep`'s cohorts: the fixed-depth one first, the adaptive ones measured against it
LOCKSTEP_COHORTS = ("fixed", "adaptive", "adaptive_equal_context")


def adaptive_lockstep(slot_counts: tuple[int, ...] = (8, 64)) -> dict:
    """Adaptive-exit gain of the decode path alone: one cohort of requests whose depths d are
    drawn from {2, 3, 4} and whose lengths make every request need about the same traversals
    (<= 128 after its first token: 128 // d tokens), so all slots decode from the first token
    to the end together; no refills, no prefill, no stragglers. Against the same cohort at fixed
    depth 4 (32 tokens each), the ideal gain is the ratio of tokens per traversal; what is
    measured includes what early exits cost (exit copies, the lm_head in more traversals).

    Two adaptive cohorts (`_lockstep`): `adaptive` with the fixed cohort's 64-token prompts,
    whose shallow requests then attend over longer contexts than the fixed ones (a depth-2
    request commits 64 tokens against 32: more attention per token, which early exit does not
    cause: with refills a request's length is its own), and `adaptive_equal_context`, whose
    prompts are shortened so that every request's mean context over its decode equals the
    fixed cohort's (64 + 32 / 2 = 80 positions)."""
    report = {}
    for slots in slot_counts:
        llm = _engine(OURO, max_num_seqs=slots)
        cohorts = _lockstep(slots)
        depths, tokens = cohorts["depths"], cohorts["tokens"]
        rates = {}
        for label in LOCKSTEP_COHORTS:
            prompts, params = cohorts[label]
            decode_rate(llm, prompts, params)  # warm-up: its graph variants captured
            runs = [decode_rate(llm, prompts, params)["decode_tok_s"] for _ in range(3)]
            rates[label] = {"median": statistics.median(runs), "runs": runs}
        traversals = max(n * d for n, d in zip(tokens, depths, strict=True))
        theory = (sum(tokens) / traversals) / (32 * slots / 128)
        row = {**rates, "depths": dict(sorted(Counter(depths).items())), "theoretical_gain": theory}
        for label in LOCKSTEP_COHORTS[1:]:
            key = label.removeprefix("adaptive")
            gain = rates[label]["median"] / rates["fixed"]["median"]
            row[f"measured_gain{key}"] = gain
            row[f"share_of_loop_savings{key}"] = (gain - 1) / (theory - 1)
        report[f"slots{slots}"] = row
        print(json.dumps({f"slots{slots}": row}), flush=True)
        del llm
    return report


def _lockstep(slots: int) -> dict:
    """adaptive_lockstep's cohorts: label -> (prompts, params) for `fixed` (depth 4, 64-token
    prompts, 32 tokens after the first), `adaptive` (max_loops d from {2, 3, 4}, the same
    prompts, 128 // d tokens after the first) and `adaptive_equal_context` (the same, prompts
    cut to 80 - tokens // 2); `depths` and `tokens` (committed after the first) of the
    adaptive requests."""
    draw = random.Random(3)
    depths = [draw.choice((2, 3, 4)) for _ in range(slots)]
    # committed tokens after the first, at most 128 traversals each: a request needing
    # 129 (43 tokens at depth 3) would cost the whole cohort one more 8-traversal window
    tokens = [128 // d for d in depths]
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 49152) for _ in range(64)] for _ in range(slots)]
    fixed = [SamplingParams(max_tokens=33, ignore_eos=True) for _ in range(slots)]
    adapt = [
        SamplingParams(max_tokens=n + 1, ignore_eos=True, max_loops=d)
        for n, d in zip(tokens, depths, strict=True)
    ]
    # mean context over a request's decode ~ prompt + tokens / 2: the fixed cohort's 80
    cut = [p[: 64 + 16 - n // 2] for p, n in zip(prompts, tokens, strict=True)]
    return {
        "fixed": (prompts, fixed),
        "adaptive": (prompts, adapt),
        "adaptive_equal_context": (cut, adapt),
        "depths": depths,
        "tokens": tokens,
    }


def profile_lockstep(slot_counts: tuple[int, ...] = (8, 64)) -> dict:
    """Where adaptive exit's extra time goes: adaptive_lockstep's cohorts (fixed depth and
    max_loops from {2,3,4}, with equal prompts and with equal mean contexts) under
    torch.profiler, GPU kernel time per decode traversal by kernel name (a traversal = one
    prepare launch), and what each adaptive cohort adds over fixed."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    report = {}
    for slots in slot_counts:
        llm = _engine(OURO, max_num_seqs=slots)
        cohorts = _lockstep(slots)
        per = {}
        for label in LOCKSTEP_COHORTS:
            prompts, params = cohorts[label]
            decode_rate(llm, prompts, params)  # warm-up: its graph variants captured
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                rate = decode_rate(llm, prompts, params)["decode_tok_s"]
            by_name: Counter = Counter()
            counts: Counter = Counter()
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    by_name[e.name[:90]] += e.device_time
                    counts[e.name[:90]] += 1
            traversals = counts.get("_prepare_kernel", 0) or 1  # one a traversal
            per[label] = {
                "decode_tok_s": rate,
                "traversals": traversals,
                "gpu_us_per_traversal": sum(by_name.values()) / traversals,
                "kernels_per_traversal": sum(counts.values()) / traversals,
                "us_per_traversal": {n: t / traversals for n, t in by_name.most_common(40)},
                "launches_per_traversal": {
                    n: counts[n] / traversals for n, _ in by_name.most_common(40)
                },
            }
        f = per["fixed"]["us_per_traversal"]
        for label in LOCKSTEP_COHORTS[1:]:
            a = per[label]["us_per_traversal"]
            added = {n: a.get(n, 0.0) - f.get(n, 0.0) for n in set(f) | set(a)}
            per[f"{label}_minus_fixed_us"] = dict(
                sorted(((n, d) for n, d in added.items() if abs(d) >= 0.5), key=lambda x: -x[1])
            )
        report[f"slots{slots}"] = per
        print(
            json.dumps({f"slots{slots}": {k: v for k, v in per.items() if "minus" in k}}),
            flush=True,
        )
        del llm
        torch.cuda.empty_cache()
    return report


def _steady(llm: LLM, prompts, params) -> dict:
    """Run every request to the end; time the engine steps that applied a decode-only plan.
    Works under async scheduling (the default on CUDA), where a step launches plan n and applies
    plan n - 1: in steady state a step's wall time is one window of GPU work, and the tokens it
    returns are plan n - 1's. "full": every slot was decoding when that plan was made."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, request_id=f"s{i}")
    from rlt_engine.core.plan import Stage

    sched, slots = engine.scheduler, engine.config.scheduler.max_num_seqs
    real_schedule, real_apply, real_step = sched.schedule, engine._apply_oldest, engine.step
    kinds: dict[int, tuple[bool, bool]] = {}  # id(plan) -> (decode only, full occupancy)
    applied: list[tuple[bool, bool]] = []
    stats = {"tokens": 0, "seconds": 0.0, "steps": 0, "full_tokens": 0, "full_seconds": 0.0}

    def schedule():
        full = sum(r.stage is Stage.DECODE for r in sched.running) == slots
        plan = real_schedule()
        if plan is not None:
            kinds[id(plan)] = (not plan.prefill and plan.decode_traversals > 0, full)
        return plan

    def apply_oldest():
        applied.append(kinds.pop(id(engine._launched[0][0]), (False, False)))
        return real_apply()

    def step():
        applied.clear()
        t = time.perf_counter()
        outs = real_step()
        seconds = time.perf_counter() - t
        tokens = sum(len(o.new_token_ids) for o in outs)
        if applied and all(decode for decode, _ in applied):
            stats["seconds"] += seconds
            stats["tokens"] += tokens
            stats["steps"] += 1
            if all(full for _, full in applied):
                stats["full_seconds"] += seconds
                stats["full_tokens"] += tokens
        return outs

    sched.schedule, engine._apply_oldest, engine.step = schedule, apply_oldest, step
    sched.trace = []
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del sched.schedule, engine._apply_oldest, engine.step  # back to the class methods
    passes = weight_passes(sched.trace, engine.model_config.num_loops)
    sched.trace = None
    full = stats["full_tokens"] / stats["full_seconds"] if stats["full_seconds"] else None
    return {
        **stats,
        "decode_tok_s": stats["tokens"] / stats["seconds"] if stats["seconds"] else None,
        "full_occupancy_tok_s": full,
        "e2e_s": time.perf_counter() - t0,
        "weight_passes": passes,
    }


def profile_adaptive() -> dict:
    """The same profile with per-request max_loops from {2,3,4} (early-exit graph variant)."""
    draw = random.Random(3)
    depths = [draw.choice((2, 3, 4)) for _ in range(8)]
    return profile(max_loops=lambda i: depths[i])


def profile(max_loops=None) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    llm = _engine(OURO, max_num_seqs=8)
    prompts, params = _workload(8, 64, 32, max_loops=max_loops)
    decode_rate(llm, prompts, params)
    runner = llm.engine.runner
    spans: list[tuple[float, float]] = []
    real = runner._decode

    def timed(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = real(n)
        torch.cuda.synchronize()
        spans.append((t, time.perf_counter()))
        return out

    runner._decode = timed
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = decode_rate(llm, prompts, params)
    runner._decode = real
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy_us = sum(e.device_time for e in kernels)
    window_s = sum(b - a for a, b in spans)
    top = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:25]
    traversals = len(spans) * llm.engine.config.execution.decode_window
    return {
        "decode_tok_s": r["decode_tok_s"],
        "windows": len(spans),
        "decode_window_wall_s": window_s,
        "gpu_kernel_time_s": busy_us / 1e6,
        "gpu_busy_share_of_window_wall": busy_us / 1e6 / window_s if window_s else None,
        "kernel_launches": len(kernels),
        "traversals": traversals,
        "window_ms_per_traversal": window_s / traversals * 1e3,
        "top_kernels": [(e.key, e.device_time_total / 1e3, e.count) for e in top],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", nargs="*", default=["exact", "agree", "bench", "adaptive", "profile"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for part in args.only:
        t = time.perf_counter()
        try:
            result = exact(args.out / "tmp") if part == "exact" else globals()[part]()
        except Exception as exc:  # record and go on: one failed part must not lose the rest
            import traceback

            result = {"error": repr(exc), "traceback": traceback.format_exc()}
        result = {**meta, "seconds": time.perf_counter() - t, **result}
        (args.out / f"{part}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(part, json.dumps(result)[:2000], flush=True)


if __name__ == "__main__":
    main()
