"""The scheduler's admission with a long queue, on the CPU (no model): the time to fill every
slot from N queued requests, and one admission after a slot frees, per policy.

    python benchmarks/admission_cpu.py --queued 1000 10000 --json

An offline batch queues every prompt at once and a busy server queues what it cannot run; at
c=256 about 16 requests finish per decode window, so each admission's host time counts 16
times a window (~21 ms on an H200 at c=256).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from scheduler_helpers import make_request, make_scheduler  # noqa: E402


def measure(policy: str, queued: int, slots: int) -> dict:
    sched = make_scheduler(
        num_blocks=10**6,
        max_num_seqs=slots,
        max_num_batched_tokens=1 << 20,
        scheduling_policy=policy,
        enable_preemption=True,
    )
    rng = random.Random(0)
    for i in range(queued):
        req = make_request(f"r{i}", 64, 32)
        if policy == "priority":  # four levels, drawn
            req.params = dataclasses.replace(req.params, priority=rng.randrange(4))
        sched.add(req)
    t = time.perf_counter()
    sched.admit()
    fill = time.perf_counter() - t
    sched.finish(sched.running[0], "abort")
    t = time.perf_counter()
    sched.admit()
    one = time.perf_counter() - t
    return {
        "policy": policy,
        "queued": queued,
        "fill_ms": fill * 1e3,
        "one_admission_ms": one * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queued", type=int, nargs="*", default=[1000, 10000])
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [measure(p, n, args.slots) for p in ("fcfs", "priority") for n in args.queued]
    if args.json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(
            f"{r['policy']:8s} queued {r['queued']:6d}: fill {args.slots} slots "
            f"{r['fill_ms']:8.1f} ms, one admission {r['one_admission_ms']:.3f} ms"
        )


if __name__ == "__main__":
    main()
