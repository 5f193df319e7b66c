"""The `rlt profile` summary, computed from a torch.profiler Chrome trace alone (torch-free).

The driver marks the engine's phases with `record_function` ranges named `rlt.*` on the thread
that steps the engine (they nest: a step holds schedule, execute and update; execute holds the
prefill waves, the decode window and the read back; ...). Here:

- **Wall time by phase** is each marker's *exclusive* time (its duration minus the markers
  nested in it), so the phases partition the workload's wall time; `host_gaps` is what no phase
  claims (the driver loop, building outputs, ...) = wall - sum of the phases.
- **GPU time by phase**: device activity (kernels, memcpys, memsets) is charged to the phase
  whose host code launched it (the runtime/driver call with the same correlation id).
- **GPU busy, decode window**: the union of device intervals inside the decode-window spans,
  divided by the spans' time. A span runs from the start of a decode window to the end of the
  `execute` that holds it, so it covers the read back that waits for the window's kernels
  (with CUDA graphs the host only enqueues replays; the GPU time shows in that wait).
  Also over the decode steps (whole engine steps that decoded and prefilled nothing: host work
  between windows included) and over the whole wall time.
- **Launches per token step**: kernels the GPU ran for the decode windows (by launch site)
  divided by the token steps (one new token for every request; `output_len - 1` per run), and
  per decode traversal; host launch calls (cudaLaunchKernel, cuLaunchKernel, cudaGraphLaunch)
  and host synchronisations likewise.
- **Sync sites**: the host's synchronising calls grouped by the phase and the innermost torch
  op they ran in (`aten::_local_scalar_dense` is an `.item()`, `aten::copy_` a copy from
  pageable memory or to the host, ...), with the time the host spent in them: where the host
  waits for the GPU instead of running ahead of it.
- **Top kernels** by total device time; on CPU (no device events) the top CPU ops by self time.
  Each kernel also gets its **added time**: how far its end lies past the previous kernel's
  end on the same stream (from its own start where the stream was idle before it). Under
  programmatic dependent launch a kernel starts while the one before still runs, so device
  times overlap and overstate; the added times of a stream sum to its busy time, and a
  kernel's is what the decode chain would lose without it.
- **Decode chain**: the decode windows' added time by link, a kernel (with its launch grid,
  which tells apart the launches of one kernel: the qkv from the o_proj) and the kernel that
  ran before it on its stream, with the median a call: where a layer's time goes, step by
  step, against what each step moves. Its cadence sorts the links by how often they run: the
  added time of a layer run, and of a traversal's own launches (prepare, the gated lm_head,
  advance) around its layers.
"""

from __future__ import annotations

import bisect
import gzip
import json
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = "rlt.workload"
STEP = "rlt.step"
# (phase, marker): the marker's exclusive time is the phase's wall time
PHASES: tuple[tuple[str, str], ...] = (
    ("schedule", "rlt.schedule"),
    ("bookkeeping", "rlt.execute"),  # copies in: slot diffs, block appends, swaps
    ("prefill", "rlt.prefill"),
    ("sampling", "rlt.sample"),
    ("decode_window", "rlt.decode_window"),
    ("read_back", "rlt.read_back"),
    ("update", "rlt.update"),
    ("detokenize", "rlt.detokenize"),
    ("add_requests", "rlt.add_request"),
)
HOST_GAPS = "host_gaps"
DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver"})

Range = tuple[float, float, str]  # (start us, end us, name)


def load_trace(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:  # type: ignore[operator]
        return json.load(f)


def exclusive_segments(ranges: Iterable[Range]) -> list[Range]:
    """Properly nested ranges -> disjoint segments, each owned by the innermost range covering
    it. A range poking out of its parent is clipped to it."""
    out: list[Range] = []
    stack: list[tuple[float, str]] = []  # (end, name)
    cursor = 0.0

    def pop_until(t: float) -> None:
        nonlocal cursor
        while stack and stack[-1][0] <= t:
            end, name = stack.pop()
            if end > cursor:
                out.append((cursor, end, name))
            cursor = max(cursor, end)

    for start, end, name in sorted(ranges, key=lambda r: (r[0], -r[1])):
        pop_until(start)
        if stack:
            if start > cursor:
                out.append((cursor, start, stack[-1][1]))
            end = min(end, stack[-1][0])
        cursor = start
        stack.append((end, name))
    pop_until(float("inf"))
    return out


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= reach:
            continue
        total += hi - max(lo, reach)
        reach = hi
    return total


def clip(intervals: Iterable[tuple[float, float]], spans: Sequence[tuple[float, float]]):
    """The parts of `intervals` inside any of the disjoint, sorted `spans`."""
    starts = [s for s, _ in spans]
    for lo, hi in intervals:
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        while i < len(spans) and spans[i][0] < hi:
            a, b = max(lo, spans[i][0]), min(hi, spans[i][1])
            if b > a:
                yield a, b
            i += 1


class _Timeline:
    """Which marker was innermost at a host timestamp, and whether it lay in given ranges."""

    def __init__(self, segments: list[Range]) -> None:
        self.segments = segments
        self.starts = [s for s, _, _ in segments]

    def owner(self, t: float) -> str | None:
        i = bisect.bisect_right(self.starts, t) - 1
        if i >= 0 and t < self.segments[i][1]:
            return self.segments[i][2]
        return None


def _inside(t: float, spans: Sequence[tuple[float, float]], starts: Sequence[float]) -> bool:
    i = bisect.bisect_right(starts, t) - 1
    return i >= 0 and t < spans[i][1]


def _merge(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def analyze(
    trace: dict[str, Any],
    *,
    token_steps: int,
    traversals: int,
    layers: int = 0,
    top: int = 15,
    cuda: bool | None = None,
) -> dict[str, Any]:
    """The summary of one profiled workload (times in ms). `token_steps`: decode token steps
    of the workload (one new token for every request each); `traversals`: decode traversals
    it ran (from the plans); `layers`: layers a traversal runs (the chain's cadence, 0: none).
    `cuda`: whether device activity was recorded (default: whether the trace holds any)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    roots = [e for e in events if e.get("cat") == "user_annotation" and e["name"] == ROOT]
    if not roots:
        raise ValueError(f"the trace holds no {ROOT!r} range: not an `rlt profile` trace")
    root = max(roots, key=lambda e: e["dur"])
    thread = (root["pid"], root["tid"])
    t0, t1 = float(root["ts"]), float(root["ts"]) + float(root["dur"])

    def on_main(e: dict[str, Any]) -> bool:
        return (e["pid"], e["tid"]) == thread and t0 <= e["ts"] <= t1

    markers = [
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("rlt.") and on_main(e)
    ]
    segments = exclusive_segments(markers)
    timeline = _Timeline(segments)
    exclusive: dict[str, float] = defaultdict(float)
    for lo, hi, name in segments:
        exclusive[name] += hi - lo
    calls: dict[str, int] = defaultdict(int)
    for _, _, name in markers:
        calls[name] += 1
    by_name: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for lo, hi, name in markers:
        by_name[name].append((lo, hi))

    # device activity, charged to the marker that launched it
    launch_ts: dict[Any, float] = {}
    runtime = [e for e in events if e.get("cat") in RUNTIME_CATS and on_main(e)]
    for e in runtime:
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            launch_ts[corr] = float(e["ts"])
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    if cuda is None:
        cuda = bool(device)
    phase_of = {marker: phase for phase, marker in PHASES}
    gpu_by_phase: dict[str, float] = defaultdict(float)
    launched: list[tuple[dict[str, Any], float]] = []
    for e in device:
        corr = (e.get("args") or {}).get("correlation")
        at = launch_ts.get(corr, float(e["ts"]))
        launched.append((e, at))
        owner = timeline.owner(at)
        if owner is not None:
            gpu_by_phase[phase_of.get(owner, HOST_GAPS)] += float(e["dur"])

    wall = t1 - t0
    phases = []
    for phase, marker in PHASES:
        ms = exclusive.get(marker, 0.0) / 1e3
        gpu = gpu_by_phase.get(phase, 0.0) / 1e3 if cuda else None
        phases.append(
            {
                "phase": phase,
                "ms": ms,
                "share": ms * 1e3 / wall if wall else 0.0,
                "calls": calls.get(marker, 0),
                "gpu_ms": gpu,
            }
        )
    phases_us = sum(exclusive.get(marker, 0.0) for _, marker in PHASES)
    gaps_us = max(0.0, wall - phases_us)
    phases.append(
        {
            "phase": HOST_GAPS,
            "ms": gaps_us / 1e3,
            "share": gaps_us / wall if wall else 0.0,
            "calls": None,
            "gpu_ms": gpu_by_phase.get(HOST_GAPS, 0.0) / 1e3 if cuda else None,
        }
    )

    windows = sorted(by_name.get("rlt.decode_window", []))
    executes = sorted(by_name.get("rlt.execute", []))
    exec_starts = [s for s, _ in executes]
    window_spans = []
    for lo, hi in windows:
        i = bisect.bisect_right(exec_starts, lo) - 1
        end = executes[i][1] if i >= 0 and executes[i][1] >= hi else hi
        window_spans.append((lo, end))
    window_spans = _merge(window_spans)
    prefills = sorted(by_name.get("rlt.prefill", []))
    decode_steps = _merge(
        (lo, hi)
        for lo, hi in by_name.get(STEP, [])
        if any(lo <= w < hi for w, _ in windows) and not any(lo <= p < hi for p, _ in prefills)
    )

    summary: dict[str, Any] = {
        "wall_ms": wall / 1e3,
        "steps": calls.get(STEP, 0),
        "phases": phases,
        "phases_ms": phases_us / 1e3,
        "host_gaps_ms": gaps_us / 1e3,
        "gpu": _gpu_summary(
            cuda,
            launched,
            runtime,
            (t0, t1),
            windows,
            window_spans,
            decode_steps,
            token_steps,
            traversals,
        ),
        "top": _top(device, events, thread, (t0, t1), top),
        "chain": _chain(launched, windows, top, traversals, layers) if cuda else None,
    }
    if cuda:
        ops = [
            (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
            for e in events
            if e.get("cat") == "cpu_op" and on_main(e)
        ]
        summary["gpu"]["sync_sites"] = sync_sites(
            runtime, timeline, _Timeline(exclusive_segments(ops)), phase_of
        )
    return summary


def sync_sites(
    runtime: list[dict[str, Any]],
    phases: _Timeline,
    ops: _Timeline,
    phase_of: dict[str, str],
    top: int = 10,
) -> list[dict[str, Any]]:
    """The synchronising runtime calls by (phase, innermost torch op), most time first."""
    sites: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for e in runtime:
        if "Synchronize" not in e["name"]:
            continue
        at = float(e["ts"])
        marker = phases.owner(at)
        phase = phase_of.get(marker, HOST_GAPS) if marker is not None else HOST_GAPS
        site = sites[(phase, ops.owner(at) or e["name"])]
        site[0] += 1
        site[1] += float(e["dur"])
    rows = [
        {"phase": phase, "op": op, "syncs": int(n), "ms": us / 1e3}
        for (phase, op), (n, us) in sites.items()
    ]
    return sorted(rows, key=lambda r: (-r["ms"], -r["syncs"], r["phase"], r["op"]))[:top]


def _gpu_summary(
    cuda: bool,
    launched: list[tuple[dict[str, Any], float]],
    runtime: list[dict[str, Any]],
    wall: tuple[float, float],
    windows: list[tuple[float, float]],
    window_spans: list[tuple[float, float]],
    decode_steps: list[tuple[float, float]],
    token_steps: int,
    traversals: int,
) -> dict[str, Any]:
    keys = (
        "busy_ms",
        "busy_share_wall",
        "decode_window_ms",
        "decode_window_busy_ms",
        "busy_share_decode_window",
        "decode_steps_ms",
        "busy_share_decode_steps",
        "kernels",
        "decode_kernels",
        "kernels_per_token_step",
        "kernels_per_traversal",
        "launch_calls",
        "decode_launch_calls",
        "launch_calls_per_token_step",
        "syncs",
        "syncs_per_token_step",
    )
    if not cuda:
        return {"available": False, **dict.fromkeys(keys), "sync_sites": None}
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e, _ in launched]
    busy_wall = union_length(clip(intervals, [wall]))
    window_ms = sum(hi - lo for lo, hi in window_spans)
    busy_window = union_length(clip(intervals, window_spans))
    steps_ms = sum(hi - lo for lo, hi in decode_steps)
    busy_steps = union_length(clip(intervals, decode_steps))
    win_starts = [s for s, _ in windows]
    kernels = [(e, at) for e, at in launched if e.get("cat") == "kernel"]
    decode_kernels = sum(1 for _, at in kernels if _inside(at, windows, win_starts))
    launches = [e for e in runtime if "Launch" in e["name"]]
    decode_launches = sum(1 for e in launches if _inside(float(e["ts"]), windows, win_starts))
    syncs = sum(1 for e in runtime if "Synchronize" in e["name"])
    per_step = token_steps or None
    return {
        "available": True,
        "busy_ms": busy_wall / 1e3,
        "busy_share_wall": _ratio(busy_wall, wall[1] - wall[0]),
        "decode_window_ms": window_ms / 1e3,
        "decode_window_busy_ms": busy_window / 1e3,
        "busy_share_decode_window": _ratio(busy_window, window_ms),
        "decode_steps_ms": steps_ms / 1e3,
        "busy_share_decode_steps": _ratio(busy_steps, steps_ms),
        "kernels": len(kernels),
        "decode_kernels": decode_kernels,
        "kernels_per_token_step": _ratio(decode_kernels, per_step),
        "kernels_per_traversal": _ratio(decode_kernels, traversals or None),
        "launch_calls": len(launches),
        "decode_launch_calls": decode_launches,
        "launch_calls_per_token_step": _ratio(decode_launches, per_step),
        "syncs": syncs,
        "syncs_per_token_step": _ratio(syncs, per_step),
    }


def _top(
    device: list[dict[str, Any]],
    events: list[dict[str, Any]],
    thread: tuple[Any, Any],
    wall: tuple[float, float],
    n: int,
) -> dict[str, Any]:
    """Top kernels by total device time; without device events, top CPU ops by self time."""
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    added: dict[str, float] | None = None
    kernels = [e for e in device if e.get("cat") == "kernel"]
    if kernels:
        kind = "cuda_kernels"
        for e in kernels:
            totals[e["name"]] += float(e["dur"])
            counts[e["name"]] += 1
        added = added_times(kernels)
    else:
        kind = "cpu_ops"
        ops = [
            (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
            for e in events
            if e.get("cat") == "cpu_op"
            and (e["pid"], e["tid"]) == thread
            and wall[0] <= e["ts"] <= wall[1]
        ]
        for _, _, name in ops:
            counts[name] += 1
        for lo, hi, name in exclusive_segments(ops):
            totals[name] += hi - lo
    total = sum(totals.values())
    added_total = sum(added.values()) if added is not None else None
    ranked = sorted(totals, key=lambda k: -totals[k])[:n]
    items = [
        {
            "name": name,
            "calls": counts[name],
            "total_ms": totals[name] / 1e3,
            "mean_us": totals[name] / counts[name],
            "share": totals[name] / total if total else 0.0,
            "added_ms": None if added is None else added[name] / 1e3,
            "added_mean_us": None if added is None else added[name] / counts[name],
            "added_share": _ratio(added[name], added_total) if added is not None else None,
        }
        for name in ranked
    ]
    return {
        "kind": kind,
        "total_ms": total / 1e3,
        "added_ms": None if added_total is None else added_total / 1e3,
        "items": items,
    }


def added_times(kernels: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per kernel name, the time (us) its calls add to their streams: each call's end past the
    latest end before it on its stream (device pid, stream tid), counted from its own start
    where the stream was idle."""
    out: dict[str, float] = defaultdict(float)
    links = added_links(kernels, [True] * len(kernels), key=lambda e: e["name"])
    for (_, name), added in links.items():
        out[name] += sum(added)
    return out


FIRST = "(first)"  # a chain link's "after" for the first kernel of a stream


def launch_key(e: dict[str, Any]) -> str:
    """A kernel call's name with its launch grid where the trace records one."""
    grid = (e.get("args") or {}).get("grid")
    return e["name"] if grid is None else f"{e['name']} {list(grid)}"


def added_links(
    kernels: Sequence[dict[str, Any]],
    keep: Iterable[bool],
    key: Callable[[dict[str, Any]], str] = launch_key,
) -> dict[tuple[str, str], list[float]]:
    """Per (key before, key) link, the time (us) each kept call adds to its stream: its end
    past the latest end before it on the stream (device pid, stream tid), from its own start
    where the stream was idle. `keep` marks the calls to record (every call moves the
    stream's timeline). The key before is that of the call with the latest end so far on the
    stream (FIRST for none)."""
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    streams: dict[tuple[Any, Any], list[tuple[dict[str, Any], bool]]] = defaultdict(list)
    for e, kept in zip(kernels, keep, strict=True):
        streams[(e.get("pid"), e.get("tid"))].append((e, kept))
    for calls in streams.values():
        last_end, before = float("-inf"), FIRST
        for e, kept in sorted(calls, key=lambda c: float(c[0]["ts"])):
            start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            name = key(e)
            if kept:
                out[(before, name)].append(max(0.0, end - max(last_end, start)))
            if end > last_end:
                last_end, before = end, name
    return out


def _chain(
    launched: list[tuple[dict[str, Any], float]],
    windows: list[tuple[float, float]],
    n: int,
    traversals: int = 0,
    layers: int = 0,
) -> dict[str, Any]:
    """The decode windows' kernels' added time by link (see the module docstring), and with
    `traversals` and `layers` its cadence (`_cadence`)."""
    kernels = [(e, at) for e, at in launched if e.get("cat") == "kernel"]
    starts = [s for s, _ in windows]
    links = added_links(
        [e for e, _ in kernels], [_inside(at, windows, starts) for _, at in kernels]
    )
    sums = {link: sum(added) for link, added in links.items()}
    total = sum(sums.values())
    ranked = sorted(sums, key=lambda link: -sums[link])[:n]
    return {
        "added_ms": total / 1e3,
        "items": [
            {
                "after": after,
                "kernel": key,
                "calls": len(links[(after, key)]),
                "added_ms": sums[(after, key)] / 1e3,
                "added_median_us": statistics.median(links[(after, key)]),
                "added_share": _ratio(sums[(after, key)], total),
            }
            for after, key in ranked
        ],
        "cadence": _cadence(sums, {link: len(a) for link, a in links.items()}, traversals, layers),
    }


def _cadence(
    sums: dict[tuple[str, str], float],
    calls: dict[tuple[str, str], int],
    traversals: int,
    layers: int,
) -> dict[str, Any] | None:
    """Every link by how often its kernel launch runs: one with at least half as many calls
    as layer runs (traversals x layers) belongs to a layer (the first layer's qkv too, which
    follows the traversal's prepare, not a norm), one with at least half as many as traversals
    to a traversal's own launches around its layers, the rest to the windows (their first and
    last launches, a prefill riding them). Each sum spread over its runs: what a layer run and
    a traversal's own launches add, in us."""
    if traversals <= 0 or layers <= 0:
        return None
    runs = traversals * layers
    launches: dict[str, int] = defaultdict(int)
    for (_, key), n in calls.items():
        launches[key] += n
    layer = sum(us for (_, key), us in sums.items() if 2 * launches[key] >= runs)
    traversal = sum(us for (_, key), us in sums.items() if traversals <= 2 * launches[key] < runs)
    return {
        "layer_runs": runs,
        "layer_us": layer / runs,
        "traversal_us": traversal / traversals,
        "other_ms": (sum(sums.values()) - layer - traversal) / 1e3,
    }
