"""`rlt profile`: one decode workload under torch.profiler, summarised by engine phase.

Same workload, loop and engine flags as `rlt bench` (rlt_cli/bench.py), one concurrency. The
driver (rlt_engine/profile/driver.py) runs `--warmup` unprofiled runs, then one profiled run with
the engine's phases marked, writes the Chrome trace (`--trace-out`; open it in
chrome://tracing or https://ui.perfetto.dev) and summarises it (rlt_engine/profile/trace.py):
wall time by phase, GPU time launched by each phase, GPU-busy share of the decode windows,
kernel launches and host syncs per token step (the syncs by phase and op: where the host
waits), and the top kernels (CPU ops on CPU), each with its added time (its end past the
previous kernel's on its stream: under PDL kernels overlap, so that, not device time, is what a
kernel costs the chain), and on a GPU the decode chain: that added time by kernel launch (its
grid) and the kernel before it, and its cadence: what a layer run adds against the layer's
weights at the device's copy rate (measured before the engine loads, as `rlt bench` does), and
what a traversal's own launches add.
Human output: tables on stdout, progress on stderr. `--json`: one JSON object on stdout.
torch loads only when run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from rlt_cli.bench import (
    JSON_PARAMETER,
    LOOP_PARAMETERS,
    PENALTY_PARAMETERS,
    WORKLOAD_FLAGS,
    Workload,
    copy_bandwidth,
    engine_flags,
    engine_summary,
    execution_text,
    load_engine,
    option,
    parse_workload,
    workload_parameters,
)
from rlt_cli.command import callback
from rlt_cli.output import check_device, print_table, status_spinner, stdout

HELP = "Profile a decode workload by engine phase and kernel (torch.profiler, Chrome trace)."
DEFAULT_CONCURRENCY = (8,)
TRACE_DIR = Path("rlt-profile")
PHASE_HELP = {
    "schedule": "Scheduler.schedule: admission, KV reservation, the step plan",
    "bookkeeping": "runner.execute's own time: slot inits/frees, block appends, swaps (copies in)",
    "prefill": "prefill waves through every loop (eager)",
    "sampling": "the sampler on the host (prefill; eager decode; in-graph sampling is decode)",
    "decode_window": "the decode window: traversals or CUDA graph replays",
    "read_back": "the one device-to-host read per step, with its sync",
    "update": "Scheduler.update: token events into requests",
    "detokenize": "incremental detokenization and stop strings",
    "add_requests": "LLMEngine.add_request",
    "host_gaps": "wall time no phase claims: the driver loop, building outputs",
}


@dataclass(frozen=True)
class ProfileRun(Workload):
    trace_out: Path | None = None
    top: int = 15


def profile_command() -> Callable[..., None]:
    parameters = [
        *workload_parameters("Requests run at once (one value; default 8).", repeats=False),
        option(
            "trace_out",
            Path | None,
            None,
            f"Chrome trace file to write (.json, or .json.gz compressed; default: "
            f"./{TRACE_DIR}/<model>-c<N>-<time>.json).",
            "Profile",
        ),
        option("top", int, 15, "Kernels (CPU ops on CPU) in the top list.", "Profile"),
        *engine_flags(),
        *LOOP_PARAMETERS,
        *PENALTY_PARAMETERS,
        JSON_PARAMETER,
    ]
    return callback(lambda values: _profile(_parse(values)), parameters, HELP, flags=WORKLOAD_FLAGS)


def _parse(values: dict[str, Any]) -> ProfileRun:
    w = parse_workload(values, DEFAULT_CONCURRENCY)
    if len(w.concurrency) != 1:
        raise ValueError(
            f"--concurrency: rlt profile runs one workload, got {len(w.concurrency)} values "
            "(profile each concurrency separately)"
        )
    if values["top"] < 1:
        raise ValueError(f"--top must be >= 1, got {values['top']}")
    trace_out = values["trace_out"]
    if trace_out is not None and trace_out.is_dir():
        raise ValueError(f"--trace-out {trace_out} is a directory; give a file name")
    return ProfileRun(**vars(w), trace_out=trace_out, top=values["top"])


def _profile(run: ProfileRun) -> None:
    check_device(run.engine_options.get("device", "auto"))
    from rlt_engine.profile.driver import Workload as DriverWorkload
    from rlt_engine.profile.driver import profile_workload

    bandwidth, _ = copy_bandwidth(None, run.engine_options)
    llm = load_engine(run)
    engine = llm.engine
    (c,) = run.concurrency
    trace_out = run.trace_out or _default_trace(engine.info.model_dir, c)
    with status_spinner("profiling") as status:

        def on_phase(text: str) -> None:
            if status is not None:
                status.update(f"concurrency {c}: {text}")

        summary = profile_workload(
            engine,
            DriverWorkload(c, run.prompt_len, run.output_len, run.warmup, run.params),
            trace_out,
            top=run.top,
            on_phase=on_phase,
        )
    report = {
        **engine_summary(engine, run),
        "concurrency": c,
        "bandwidth_gbs": bandwidth / 1e9 if bandwidth is not None else None,
        **summary,
    }
    if run.json_output:
        typer.echo(json.dumps(report))
        return
    _render(report)


def _default_trace(model_dir: Path, concurrency: int) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return TRACE_DIR / f"{Path(model_dir).name or 'model'}-c{concurrency}-{stamp}.json"


# -- rendering ----------------------------------------------------------------------------
def _render(report: dict[str, Any]) -> None:
    gpu = report["gpu"]
    stdout.print(
        f"[bold]{escape(report['model'])}[/] ({report['device_name']}, {report['dtype']}; "
        f"{execution_text(report)}): concurrency {report['concurrency']}, "
        f"{report['prompt_len']}-token prompts, {report['output_len']} output tokens, "
        f"{report['engine_steps']} engine steps, {report['decode_traversals']} decode "
        f"traversals; {report['decode_tokens_per_s']:.1f} decode tok/s under the profiler"
    )
    stdout.print(_phase_table(report))
    if gpu["available"]:
        stdout.print(
            f"GPU busy: {_pct(gpu['busy_share_decode_window'])} of the decode windows "
            f"({gpu['decode_window_busy_ms']:.1f} of {gpu['decode_window_ms']:.1f} ms), "
            f"{_pct(gpu['busy_share_decode_steps'])} of the decode steps, "
            f"{_pct(gpu['busy_share_wall'])} of wall time"
        )
        stdout.print(
            f"Per token step: {_num(gpu['kernels_per_token_step'])} kernels "
            f"({_num(gpu['kernels_per_traversal'])} per traversal), "
            f"{_num(gpu['launch_calls_per_token_step'])} host launch calls, "
            f"{_num(gpu['syncs_per_token_step'])} host syncs"
        )
        if gpu["sync_sites"]:
            print_table(_sync_table(gpu["sync_sites"]))
    else:
        stdout.print("GPU busy: n/a (CPU run); kernels per token step: n/a")
    if report["graphs_captured"]:
        stdout.print(
            f"[yellow]{report['graphs_captured']} CUDA graph(s) captured during the profiled "
            f"run ({report['graph_capture_s']:.2f} s of host time, in the phases above): "
            "raise --warmup to profile without them[/]"
        )
    if report["missing_markers"]:
        stdout.print(
            f"[yellow]not marked (the engine has no such method): "
            f"{escape(', '.join(report['missing_markers']))}[/]"
        )
    print_table(_top_table(report))
    if report.get("chain") and report["chain"]["items"]:
        print_table(_chain_table(report["chain"]))
        line = _cadence_line(report)
        if line:
            stdout.print(line)
    stdout.print(f"trace: {escape(report['trace'])}")


def _phase_table(report: dict[str, Any]) -> Table:
    cuda = report["gpu"]["available"]
    table = Table(
        title=f"wall time by phase ({report['wall_ms']:.1f} ms profiled)",
        title_justify="left",
        box=None,
        pad_edge=False,
    )
    table.add_column("phase")
    for name in ("ms", "% wall", "calls", *(("GPU ms",) if cuda else ())):
        table.add_column(name, justify="right")
    table.add_column("what", style="dim")
    for row in report["phases"]:
        cells = [
            row["phase"],
            f"{row['ms']:.2f}",
            f"{100 * row['share']:.1f}%",
            "" if row["calls"] is None else str(row["calls"]),
        ]
        if cuda:
            cells.append(f"{row['gpu_ms']:.2f}")
        table.add_row(*cells, PHASE_HELP.get(row["phase"], ""))
    return table


def _top_table(report: dict[str, Any]) -> Table:
    top = report["top"]
    kind = "kernels by device time" if top["kind"] == "cuda_kernels" else "CPU ops by self time"
    table = Table(
        title=f"top {len(top['items'])} {kind} ({top['total_ms']:.1f} ms in all)",
        title_justify="left",
        box=None,
        pad_edge=False,
    )
    for name, justify in (("total ms", "right"), ("%", "right"), ("calls", "right")):
        table.add_column(name, justify=justify)
    table.add_column("mean us", justify="right")
    added = top.get("added_ms") is not None
    if added:  # under PDL device times overlap: what each call adds to its stream's timeline
        table.add_column("added us", justify="right")
        table.add_column("% added", justify="right")
    table.add_column("name", overflow="ellipsis", no_wrap=True, max_width=100)
    for item in top["items"]:
        cells = [
            f"{item['total_ms']:.2f}",
            f"{100 * item['share']:.1f}%",
            str(item["calls"]),
            f"{item['mean_us']:.1f}",
        ]
        if added:
            cells += [f"{item['added_mean_us']:.1f}", _pct(item["added_share"])]
        table.add_row(*cells, escape(item["name"]))
    if added:
        table.caption = (
            "added us: a call's end past the previous kernel's end on its stream (kernels "
            "overlap under PDL; the added times sum to the busy time)"
        )
        table.caption_justify = "left"
    return _fit_names(table, 1, 100)


def _chain_table(chain: dict[str, Any], width: int | None = None) -> Table:
    table = Table(
        title=f"decode chain: added time by kernel and the kernel before it "
        f"({chain['added_ms']:.1f} ms in all)",
        title_justify="left",
        box=None,
        pad_edge=False,
    )
    headers = ("added ms", "%", "calls", "median us")
    numbers = [
        (
            f"{item['added_ms']:.2f}",
            _pct(item["added_share"]),
            str(item["calls"]),
            f"{item['added_median_us']:.2f}",
        )
        for item in chain["items"]
    ]
    share = _name_width(headers, numbers, 2, 48, width)
    for name in headers:
        table.add_column(name, justify="right")
    for name in ("after", "kernel [grid]"):
        table.add_column(name, overflow="ellipsis", no_wrap=True, max_width=share)
    for cells, item in zip(numbers, chain["items"], strict=True):
        keys = (_short_key(item["after"], share), _short_key(item["kernel"], share))
        table.add_row(*cells, *map(escape, keys))
    table.caption = (
        "a layer step by step: each link's added time against the bytes its kernel moves "
        "says where the chain waits instead of streaming"
    )
    table.caption_justify = "left"
    return table


def _cadence_line(report: dict[str, Any]) -> str | None:
    """The chain's cadence in words: a layer run's added time against its weights at the copy
    rate, and a traversal's own launches."""
    cadence = report["chain"].get("cadence")
    if not cadence:
        return None
    text = f"a layer run adds {cadence['layer_us']:.1f} us ({cadence['layer_runs']:,} runs)"
    layer_bytes, bandwidth = report.get("layer_weight_bytes"), report.get("bandwidth_gbs")
    if layer_bytes and bandwidth:
        at_copy = layer_bytes / (bandwidth * 1e3)  # bytes / (GB/s) in us
        text += (
            f"; its weights, {layer_bytes / 1e6:.1f} MB, take {at_copy:.1f} us at the copy "
            f"rate ({bandwidth / 1e3:.2f} TB/s), {_pct(at_copy / cadence['layer_us'])} of it"
        )
    text += (
        f". A traversal's own launches (prepare, the lm_head when a row exits, advance) add "
        f"{cadence['traversal_us']:.1f} us; the windows' other launches "
        f"{cadence['other_ms']:.2f} ms"
    )
    return text


def _sync_table(sites: list[dict[str, Any]]) -> Table:
    table = Table(
        title="host syncs by phase and op (ms: the host waiting)",
        title_justify="left",
        box=None,
        pad_edge=False,
    )
    for name, justify in (("ms", "right"), ("syncs", "right"), ("phase", "left")):
        table.add_column(name, justify=justify)
    table.add_column("innermost op", overflow="ellipsis", no_wrap=True, max_width=60)
    for site in sites:
        table.add_row(f"{site['ms']:.2f}", str(site["syncs"]), site["phase"], escape(site["op"]))
    return _fit_names(table, 1, 60)


def _fit_names(table: Table, names: int, cap: int) -> Table:
    """Give the table's last `names` columns (names cut with an ellipsis) what the terminal
    leaves beside its other columns (`_name_width`)."""
    others = table.columns[: len(table.columns) - names]
    cells = list(zip(*(list(c.cells) for c in others), strict=True))
    share = _name_width([c.header for c in others], cells, names, cap, None)
    for column in table.columns[len(table.columns) - names :]:
        column.max_width = share
    return table


def _name_width(
    headers: Sequence[Any], rows: Sequence[Sequence[Any]], names: int, cap: int, width: int | None
) -> int:
    """Columns each of `names` name columns may take beside columns of these headers and
    rows, on a terminal of `width` columns (default stdout's), at most `cap`, at least 8. Rich
    does not shorten text it may not wrap: on an 80-column terminal it dropped every number
    column of the chain table instead."""
    width = stdout.width if width is None else width
    widths = [len(str(h)) for h in headers]
    for row in rows:
        widths = [max(w, len(str(cell))) for w, cell in zip(widths, row, strict=True)]
    padding = 2 * (len(headers) + names) - 2  # a space each side of a column, none at the edges
    return max(8, min(cap, (width - sum(widths) - padding) // names))


def _short_key(key: str, width: int) -> str:
    """A chain key cut to `width` characters, its launch grid kept: 'ws_gemm_kernel [88, 1,
    1]' in 21 reads 'ws_gemm_k… [88, 1, 1]'."""
    if len(key) <= width:
        return key
    name, sep, grid = key.rpartition(" [")
    keep = width - len(grid) - 3  # the ellipsis, the space and the bracket
    if not sep or not key.endswith("]") or keep < 4:
        return key[: width - 1] + "…"
    return f"{name[:keep]}… [{grid}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.1f}"
