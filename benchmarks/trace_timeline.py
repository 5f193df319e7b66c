"""The GPU time line of an `rlt profile --trace-out` Chrome trace, traversal by traversal: where
the GPU idles between kernels and what runs outside the layer stack.

    python -m rlt_cli.main profile --model tests/fixtures/ouro-1.4b --load-format dummy \\
        --prompt-len 64 --output-len 32 -c 1 --trace-out /tmp/trace.json
    python benchmarks/trace_timeline.py /tmp/trace.json [--out timeline.txt] [--json]

GPU events (kernels, copies, memsets) in start order, split into traversals at each
`_prepare_kernel` (the first kernel of a decode traversal). A traversal over 20 ms holds a host
wait or a prefill and is left out of the statistics. Reports, in us:
- the steady traversals' median, min and max;
- idle gaps over 0.3 us inside them, summed per (kernel before, kernel after): with PDL the
  layer stack has none, so what remains is launches outside the PDL chain (torch kernels,
  copies, graph boundaries);
- every gap over 2 us from the first traversal on (window boundaries, host waits);
- one mid-run traversal: the kernels outside the layer stack with their start, end and
  duration from the traversal's start, and a window boundary's events.
Results: benchmarks/results/2026-12-04-tail-h200.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import NamedTuple

TRAVERSAL_START = "_prepare_kernel"
LAYER_KERNELS = ("ws_gemm", "_add_rms_norm", "_paged_attention", "_decode_rows")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LONG_US = 20_000.0  # a traversal this long holds a host wait or a prefill
IDLE_US = 0.3  # a gap shorter than this is clock noise between back-to-back kernels
BIG_GAP_US = 2.0


class Event(NamedTuple):
    start: float
    end: float
    name: str


def gpu_events(trace: dict) -> list[Event]:
    """The trace's GPU events (us), in start order."""
    return sorted(
        Event(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
        for e in trace["traceEvents"]
        if e.get("cat") in GPU_CATEGORIES and "dur" in e
    )


def idle_gaps(events: list[Event]) -> list[tuple[float, int]]:
    """(idle us, index of the event after the gap) for every gap in `events`: the time from
    the latest end so far to the next start."""
    gaps, end = [], events[0].end if events else 0.0
    for i in range(1, len(events)):
        if events[i].start > end:
            gaps.append((events[i].start - end, i))
        end = max(end, events[i].end)
    return gaps


def summarize(events: list[Event]) -> dict:
    starts = [i for i, e in enumerate(events) if e.name.startswith(TRAVERSAL_START)]
    steady: list[float] = []
    pairs: Counter[str] = Counter()
    pair_us: Counter[str] = Counter()
    for a, b in itertools.pairwise(starts):
        span = events[b].start - events[a].start
        if span > LONG_US:
            continue
        steady.append(span)
        for gap, i in idle_gaps(events[a : b + 1]):
            if gap > IDLE_US:
                key = f"{_short(events[a + i - 1].name)} -> {_short(events[a + i].name)}"
                pairs[key] += 1
                pair_us[key] += gap
    first = starts[0] if starts else 0
    big = [
        (gap, events[first + i].start - events[first].start, first + i)
        for gap, i in idle_gaps(events[first:])
        if gap > BIG_GAP_US
    ]
    out: dict = {
        "events": len(events),
        "traversals": len(starts),
        "steady_traversals": len(steady),
        "traversal_us": _stats(steady),
        "idle_inside_traversals": [
            {"between": key, "us": round(us, 2), "count": pairs[key]}
            for key, us in pair_us.most_common(25)
        ],
        "big_gaps": {
            "count": len(big),
            "us": round(sum(g for g, *_ in big), 1),
            "largest": [
                {
                    "us": round(g, 1),
                    "at_us": round(at, 1),
                    "between": f"{_short(events[j - 1].name)} -> {_short(events[j].name)}",
                }
                for g, at, j in sorted(big, reverse=True)[:20]
            ],
        },
    }
    if len(starts) >= 3:
        mid = len(starts) // 2
        a, b = starts[mid], starts[mid + 1]
        t0 = events[a].start
        out["outside_the_layer_stack"] = [
            _row(e, t0) for e in events[a : b + 1] if not e.name.startswith(LAYER_KERNELS)
        ]
        boundary = next((j for _, _, j in big if j > a), None)
        if boundary is not None:
            t0 = events[boundary].start
            out["window_boundary"] = [_row(e, t0) for e in events[boundary - 8 : boundary + 6]]
    return out


def render(summary: dict) -> str:
    s = summary
    lines = [f"{s['events']} GPU events, {s['traversals']} traversals"]
    if s["traversal_us"]:
        t = s["traversal_us"]
        lines.append(
            f"steady traversals {s['steady_traversals']}: median {t['median']} us, "
            f"min {t['min']}, max {t['max']}"
        )
    lines.append(f"idle gaps > {IDLE_US} us inside them (us, count, between):")
    lines += [
        f"  {g['us']:9.1f} {g['count']:6d}  {g['between']}" for g in s["idle_inside_traversals"]
    ]
    big = s["big_gaps"]
    lines.append(
        f"gaps > {BIG_GAP_US} us from the first traversal on: {big['count']}, {big['us']} us"
    )
    lines += [f"  {g['us']:9.1f} us at {g['at_us']:10.1f}  {g['between']}" for g in big["largest"]]
    for key, title in (
        ("outside_the_layer_stack", "a mid-run traversal, outside the layer stack"),
        ("window_boundary", "a window boundary (from the event after the gap)"),
    ):
        if key in s:
            lines.append(f"{title} (start, end, us):")
            lines += [f"  {r[0]:9.2f} {r[1]:9.2f} {r[2]:7.2f}  {r[3]}" for r in s[key]]
    return "\n".join(lines) + "\n"


def _stats(values: list[float]) -> dict:
    if not values:
        return {}
    return {
        "median": round(statistics.median(values), 1),
        "min": round(min(values), 1),
        "max": round(max(values), 1),
    }


def _row(e: Event, t0: float) -> tuple[float, float, float, str]:
    return (round(e.start - t0, 2), round(e.end - t0, 2), round(e.end - e.start, 2), e.name[:70])


def _short(name: str) -> str:
    return name[:38]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="a Chrome trace of `rlt profile --trace-out`")
    ap.add_argument("--out", type=Path, help="also write the report here")
    ap.add_argument("--json", action="store_true", help="the summary as JSON")
    args = ap.parse_args(argv)
    summary = summarize(gpu_events(json.loads(args.trace.read_text())))
    text = json.dumps(summary, indent=1) if args.json else render(summary)
    if args.out:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
