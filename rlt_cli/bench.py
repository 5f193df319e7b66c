"""`rlt bench`: offline, in-process decode benchmark over several batch sizes.

Random token-id prompts of exactly `--prompt-len` tokens (seeded), so tokenizer-less dummy
models work too (`--load-format dummy` runs every alias offline from its bundled config). Per
concurrency: committed decode tokens/s, from every request's first token to the last completion
(median over repeats, rlt_engine/bench/throughput.py), TTFT p50/p90, TPOT p50, E2E p50, the
exit-depth histogram of every output token, the peak GPU memory (CUDA) and the share of the
weight-bandwidth floor (rlt_engine/bench/floor.py: the model's weight bytes per token step over
a copy bandwidth measured on the device at start, or `--bandwidth-gbs`). Human output: a table
on stdout, notices and progress on stderr. `--json`: one JSON object on stdout, nothing else.

The engine flags are those of `rlt generate` (rlt_cli/options.py), except that
`--max-num-seqs` defaults to enough slots for the largest `--concurrency`. The workload, loop
and engine flags are shared with `rlt profile` (rlt_cli/profile.py builds on this module).
torch loads only when run.

`--url URL` switches to the serving benchmark (rlt_engine/bench/serving.py) against any
OpenAI-compatible server: no model is loaded here, `--model` names the served model, engine
flags are refused (they belong to the server), `--prompt-len` (alias `--input-len`) and
`--output-len` shape the requests, and loop-control flags given are sent as extension fields.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from rlt_cli.command import callback, keyword
from rlt_cli.engine import load_llm
from rlt_cli.options import HELP as OPTION_HELP
from rlt_cli.options import engine_fields, engine_parameters, to_field_values
from rlt_cli.output import check_device, print_table, status_spinner, stderr
from rlt_engine.config import EngineConfig, SchedulerConfig
from rlt_engine.sampling_params import SamplingParams

try:  # recent typer vendors click as typer._click
    from typer._click.core import ParameterSource
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - older typer uses the click package
    from click import get_current_context
    from click.core import ParameterSource

if TYPE_CHECKING:
    from rlt_engine.bench.serving import ServingBenchConfig
    from rlt_engine.core.exit_rule import LoopControls
    from rlt_engine.engine import LLMEngine
    from rlt_engine.llm import LLM

HELP = (
    "Benchmark offline decode throughput and latency (tok/s, TTFT, TPOT) in-process, or with "
    "--url a running OpenAI-compatible server (TTFT, TPOT, ITL, E2E, throughput)."
)
DEFAULT_CONCURRENCY = (1, 8)
DEFAULT_MAX_NUM_SEQS = SchedulerConfig.max_num_seqs
# SamplingParams fields that the workload flags set, for error messages (rlt_cli/command.py)
WORKLOAD_FLAGS = {"max_tokens": "--output-len"}
SERVING_PANEL = "Serving benchmark (--url)"
# serving-benchmark fields whose flag is not --field-name, for error messages
SERVING_FLAGS = {"input_len": "--input-len"}


@dataclass(frozen=True)
class Workload:
    """What `rlt bench` and `rlt profile` share: the engine, the requests, the output mode."""

    engine_options: dict[str, Any]
    concurrency: tuple[int, ...]
    prompt_len: int
    output_len: int
    warmup: int
    params: SamplingParams  # loop controls; greedy, ignore_eos, max_tokens = output_len
    json_output: bool


@dataclass(frozen=True)
class BenchRun(Workload):
    repeats: int = 3
    bandwidth_gbs: float | None = None  # None: measure on CUDA, n/a on CPU


def bench_command() -> Callable[..., None]:
    """The Typer callback: the engine flags are built from the config dataclasses."""
    workload = workload_parameters(
        "Requests run at once: repeat the flag or give a comma list, e.g. -c 1 -c 8 or "
        "-c 1,8,64,256 (default: 1 and 8).",
        repeats=True,
    )
    workload = [_PROMPT_LEN if p.name == "prompt_len" else p for p in workload]
    parameters = [
        *workload,
        _BANDWIDTH,
        *SERVING_PARAMETERS,
        *engine_flags(),
        *LOOP_PARAMETERS,
        *PENALTY_PARAMETERS,
        JSON_PARAMETER,
    ]
    flags = {**WORKLOAD_FLAGS, **SERVING_FLAGS}
    return callback(_run, parameters, HELP, flags=flags)


def _run(values: dict[str, Any]) -> None:
    if values["url"] is None:
        given = _given([p.name for p in SERVING_PARAMETERS])
        if given:
            raise ValueError(f"{_flag(given[0])} is for the serving benchmark: give --url too")
        _bench(_parse(values))
        return
    _serve_bench(_parse_serving(values), json_output=values["json_output"])


# -- flags shared with `rlt profile` ------------------------------------------------------
def option(name: str, kind: Any, default: Any, help: str, panel: str) -> inspect.Parameter:
    flag = typer.Option("--" + name.replace("_", "-"), help=help, rich_help_panel=panel)
    return keyword(name, Annotated[kind, flag], default)


def _concurrency_list(values: list[str] | None) -> list[int] | None:
    """`-c 1 -c 8` and `-c 1,8,64` alike (a bad value is a usage error naming the flag)."""
    if not values:
        return None
    out = []
    for value in values:
        for part in value.split(","):
            try:
                out.append(int(part.strip()))
            except ValueError:
                raise typer.BadParameter(f"{part.strip()!r} is not an integer") from None
    return out


def workload_parameters(concurrency_help: str, *, repeats: bool) -> list[inspect.Parameter]:
    concurrency = keyword(
        "concurrency",
        Annotated[
            list[str] | None,
            typer.Option(
                "--concurrency",
                "-c",
                help=concurrency_help,
                rich_help_panel="Workload",
                callback=_concurrency_list,
                metavar="N[,N...]",
            ),
        ],
        None,
    )
    out = [
        concurrency,
        option("prompt_len", int, 64, "Prompt tokens per request (random ids).", "Workload"),
        option("output_len", int, 32, "Output tokens per request (ignore_eos), >= 2.", "Workload"),
    ]
    if repeats:
        out.append(
            option(
                "repeats", int, 3, "Measured runs per concurrency (median reported).", "Workload"
            )
        )
    out.append(
        option(
            "warmup",
            int,
            1,
            "Discarded (and unprofiled) runs per concurrency before measuring.",
            "Workload",
        )
    )
    return out


def engine_flags() -> list[inspect.Parameter]:
    """The engine flags of `rlt generate`, with --max-num-seqs following --concurrency."""
    out = []
    for p in engine_parameters():
        if p.name == "max_num_seqs":
            flag = typer.Option(
                "--max-num-seqs",
                help=f"Most requests running at once (default: the largest --concurrency, "
                f"at least {DEFAULT_MAX_NUM_SEQS}).",
                rich_help_panel="Engine",
            )
            p = keyword("max_num_seqs", Annotated[int | None, flag], None)
        out.append(p)
    return out


LOOP_PARAMETERS = [
    option(
        "exit_threshold",
        float,
        1.0,
        "Exit once the gate's cumulative exit probability reaches this, in 0..1; 1 = fixed depth.",
        "Loop controls",
    ),
    option("min_loops", int | None, None, "Least loops per token (default 1).", "Loop controls"),
    option("max_loops", int | None, None, OPTION_HELP["max_loops"], "Loop controls"),
]
# the sampler's logit-edit variant (its cost), greedy otherwise
PENALTY_PARAMETERS = [
    option(name, float, default, OPTION_HELP[name], "Sampling")
    for name, default in (
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("repetition_penalty", 1.0),
    )
]
JSON_PARAMETER = keyword(
    "json_output",
    Annotated[bool, typer.Option("--json", help="Print one JSON object; no table.")],
    False,
)
_PROMPT_LEN = keyword(
    "prompt_len",
    Annotated[
        int,
        typer.Option(
            "--prompt-len",
            "--input-len",
            help="Prompt tokens per request (random ids).",
            rich_help_panel="Workload",
        ),
    ],
    64,
)
SERVING_PARAMETERS = [
    option(
        "url",
        str | None,
        None,
        "Benchmark the OpenAI-compatible server at this base URL (e.g. http://127.0.0.1:8000) "
        "instead of loading a model; --model then names the served model (default: the "
        "server's first).",
        SERVING_PANEL,
    ),
    option("num_prompts", int, 200, "Requests to send.", SERVING_PANEL),
    option(
        "request_rate",
        float,
        math.inf,
        "Poisson arrivals at this many requests/s; inf = all at once.",
        SERVING_PANEL,
    ),
    option(
        "max_concurrency",
        int | None,
        None,
        "Most requests in flight at once (default: no limit).",
        SERVING_PANEL,
    ),
    option(
        "dataset",
        str,
        "random",
        "random (token ids of --input-len) or gsm8k (questions from --dataset-path).",
        SERVING_PANEL,
    ),
    option(
        "dataset_path",
        Path | None,
        None,
        'gsm8k: a JSONL file of {"question": ...} objects.',
        SERVING_PANEL,
    ),
    option("seed", int, 0, "Seed of the prompts and the arrival times.", SERVING_PANEL),
    option(
        "api_key",
        str | None,
        None,
        "Send `Authorization: Bearer KEY` (default: $OPENAI_API_KEY, else none).",
        SERVING_PANEL,
    ),
]
_BANDWIDTH = option(
    "bandwidth_gbs",
    float | None,
    None,
    "Device copy bandwidth in GB/s (read + write) for the weight-bandwidth floor "
    "(default: measured on CUDA at start; without it the floor is n/a on CPU).",
    "Workload",
)


# -- parsing and validation (no torch) ----------------------------------------------------
def parse_workload(values: dict[str, Any], default_concurrency: tuple[int, ...]) -> Workload:
    concurrency = tuple(values["concurrency"] or default_concurrency)
    for c in concurrency:
        if c < 1:
            raise ValueError(f"--concurrency must be >= 1, got {c}")
    if values["max_num_seqs"] is None:
        values = {**values, "max_num_seqs": max(DEFAULT_MAX_NUM_SEQS, *concurrency)}
    engine_options = to_field_values(values, [f.name for f in engine_fields()])
    config = EngineConfig.from_options(**dict(engine_options))  # fail fast, before torch
    max_seqs = config.scheduler.max_num_seqs
    if max(concurrency) > max_seqs:
        raise ValueError(
            f"--concurrency {max(concurrency)} exceeds --max-num-seqs {max_seqs}: the requests "
            "would not all run at once"
        )
    for name, least in (("prompt_len", 1), ("output_len", 2), ("repeats", 1), ("warmup", 0)):
        if name in values and values[name] < least:
            flag = "--" + name.replace("_", "-")
            why = " (decode time starts after the first token)" if name == "output_len" else ""
            raise ValueError(f"{flag} must be >= {least}{why}, got {values[name]}")
    params = SamplingParams(
        max_tokens=values["output_len"],
        ignore_eos=True,
        min_loops=values["min_loops"],
        max_loops=values["max_loops"],
        exit_threshold=values["exit_threshold"],
        **{p.name: values[p.name] for p in PENALTY_PARAMETERS},
    )
    lo, hi = params.min_loops, params.max_loops
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"min_loops ({lo}) must be <= max_loops ({hi})")
    return Workload(
        engine_options=engine_options,
        concurrency=tuple(dict.fromkeys(concurrency)),  # in order, without repeats
        prompt_len=values["prompt_len"],
        output_len=values["output_len"],
        warmup=values["warmup"],
        params=params,
        json_output=values["json_output"],
    )


def _parse(values: dict[str, Any]) -> BenchRun:
    w = parse_workload(values, DEFAULT_CONCURRENCY)
    bandwidth = values["bandwidth_gbs"]
    if bandwidth is not None and not bandwidth > 0:
        raise ValueError(f"--bandwidth-gbs must be > 0, got {bandwidth}")
    return BenchRun(**vars(w), repeats=values["repeats"], bandwidth_gbs=bandwidth)


def _given(names: list[str]) -> list[str]:
    """The flags among `names` given on the command line (or by environment), in order."""
    ctx = get_current_context(silent=True)
    if ctx is None:
        return []
    unset = (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)
    return [name for name in names if ctx.get_parameter_source(name) not in unset]


def _flag(name: str) -> str:
    return SERVING_FLAGS.get(name, "--" + name.replace("_", "-"))


# offline-only flags refused with --url; --model stays (the served model's name)
OFFLINE_ONLY = ("concurrency", "repeats", "warmup", "bandwidth_gbs")
# why a refused flag has no place with --url, where the generic reason would mislead
URL_REFUSALS = {
    "concurrency": "the serving benchmark bounds the requests in flight with --max-concurrency "
    "(and paces arrivals with --request-rate)",
}


def _parse_serving(values: dict[str, Any]) -> ServingBenchConfig:
    from rlt_engine.bench.serving import ServingBenchConfig

    refused = [*OFFLINE_ONLY, *(p.name for p in engine_flags() if p.name != "model")]
    given = _given(refused)
    if given:
        why = URL_REFUSALS.get(
            given[0], "the serving benchmark loads no model (give engine flags to the server)"
        )
        raise ValueError(f"{_flag(given[0])} cannot be used with --url: {why}")
    sent = [p.name for p in (*LOOP_PARAMETERS, *PENALTY_PARAMETERS)]
    loops = {name: values[name] for name in _given(sent)}
    return ServingBenchConfig(
        url=values["url"],
        num_prompts=values["num_prompts"],
        request_rate=values["request_rate"],
        max_concurrency=values["max_concurrency"],
        input_len=values["prompt_len"],
        output_len=values["output_len"],
        dataset=values["dataset"],
        dataset_path=values["dataset_path"],
        model=values["model"],
        api_key=values["api_key"] or os.environ.get("OPENAI_API_KEY") or None,
        seed=values["seed"],
        extra_body=loops,
    )


# -- running ------------------------------------------------------------------------------
def load_engine(w: Workload) -> LLM:
    """Load the model and check the workload against it (loop controls, context)."""
    llm = load_llm(w.engine_options)
    info = llm.info
    if info.notice:
        stderr.print(f"[dim]{escape(info.notice)}[/]")
    llm.engine.loop_controls(w.params)  # the engine's defaults, validated against the model
    if w.prompt_len + w.output_len > info.max_model_len:
        raise ValueError(
            f"--prompt-len {w.prompt_len} + --output-len {w.output_len} exceeds the "
            f"model's context of {info.max_model_len} positions"
        )
    return llm


def engine_summary(engine: LLMEngine, w: Workload) -> dict[str, Any]:
    """The report header: model, device and the execution settings that actually run."""
    import torch

    info = engine.info
    controls = engine.loop_controls(w.params)
    return {
        "model": info.model_dir,
        "device": info.device,
        "device_name": info.device_name,
        "torch": torch.__version__,
        "dtype": info.dtype,
        "num_loops": info.num_loops,
        "num_blocks": info.num_blocks,
        "max_num_seqs": info.max_num_seqs,
        "attention_backend": info.attention_backend,  # as asked (auto, torch, ...)
        "attention_impl": info.attention_impl,  # what runs
        "enforce_eager": engine.config.execution.enforce_eager,
        "cuda_graphs": info.cuda_graphs,
        "graphs_at_start": info.graphs_at_start,
        "graph_capture_s_at_start": info.graph_capture_s_at_start,
        "decode_window": info.decode_window,
        "kernels": info.kernels,
        "prompt_len": w.prompt_len,
        "output_len": w.output_len,
        "warmup": w.warmup,
        "min_loops": controls.min_loops,
        "max_loops": controls.max_loops,
        "exit_threshold": controls.exit_threshold,
        **{p.name: getattr(w.params, p.name) for p in PENALTY_PARAMETERS},
    }


def _engine_device(options: dict[str, Any]) -> Any:
    import torch

    device = options.get("device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def copy_bandwidth(
    given_gbs: float | None, options: dict[str, Any]
) -> tuple[float | None, str | None]:
    """(bytes/s, "given" | "measured") for the floor: the given GB/s, else measured on a CUDA
    device (before the engine, whose KV pool takes the memory the copy needs); (None, None) on
    CPU."""
    if given_gbs is not None:
        return given_gbs * 1e9, "given"
    device = _engine_device(options)
    if device.type != "cuda":
        return None, None
    from rlt_engine.bench.floor import measure_copy_bandwidth

    with status_spinner("measuring copy bandwidth"):
        return measure_copy_bandwidth(device), "measured"


def _bench(run: BenchRun) -> None:
    check_device(run.engine_options.get("device", "auto"))
    from rlt_engine.bench.floor import weight_bytes
    from rlt_engine.bench.throughput import benchmark

    bandwidth, source = copy_bandwidth(run.bandwidth_gbs, run.engine_options)
    llm = load_engine(run)
    engine = llm.engine
    depth = engine.info.num_loops
    controls = engine.loop_controls(run.params)
    weights = weight_bytes(engine.model)

    results = []
    with status_spinner("benchmarking") as status:
        for c in run.concurrency:

            def on_run(phase: str, i: int, n: int, c: int = c) -> None:
                if status is not None:
                    status.update(f"concurrency {c}: {phase} {i}/{n}")

            # distinct prompts per concurrency, so no run reuses another's prefix cache
            r = benchmark(
                engine,
                c,
                run.prompt_len,
                run.output_len,
                run.repeats,
                run.warmup,
                run.params,
                on_run,
                seed=10_000 * c,
            )
            results.append(_result(r, depth, controls, weights, bandwidth))

    report = {
        **engine_summary(engine, run),
        "repeats": run.repeats,
        "bandwidth_gbs": bandwidth / 1e9 if bandwidth is not None else None,
        "bandwidth_source": source,  # measured | given | None
        "weight_bytes": {
            "layer_stack": weights.layer_stack,
            "coda": weights.coda,
            "embedding_row": weights.embedding_row,
            "per_token_step_at_full_depth": weights.per_token_step(depth),
        },
        "results": results,
    }
    if run.json_output:
        typer.echo(json.dumps(report))
        return
    print_table(_table(report))


def _serve_bench(config: ServingBenchConfig, *, json_output: bool) -> None:
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from rlt_engine.bench.serving import benchmark

    columns = (
        SpinnerColumn(),
        TextColumn("requests"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} done, {task.fields[failed]} failed"),
        TimeElapsedColumn(),
    )
    with Progress(
        *columns, console=stderr, transient=True, disable=not stderr.is_terminal
    ) as progress:
        task = progress.add_task("requests", total=config.num_prompts, failed=0)

        def on_progress(done: int, failed: int, total: int) -> None:
            progress.update(task, completed=done, failed=failed)

        report = benchmark(config, on_progress)
    if json_output:
        typer.echo(json.dumps(report))
        return
    print_table(_serving_table(report))
    for message, count in list(report["errors"].items())[:3]:
        stderr.print(f"[red]{count} failed: {escape(message)}[/]")


def floor_loops(exit_depths: dict[int, int], controls: LoopControls) -> float:
    """Traversals per token step the floor assumes: the fixed depth (max loops) at exit
    threshold 1, else the measured mean exit depth."""
    if controls.exit_threshold >= 1 or not exit_depths:
        return float(controls.max_loops)
    return sum(d * n for d, n in exit_depths.items()) / sum(exit_depths.values())


def _result(
    r: dict[str, Any], depth: int, controls: LoopControls, weights: Any, bandwidth: float | None
) -> dict[str, Any]:
    from rlt_engine.bench.floor import floor_tokens_per_s

    loops = floor_loops(r["exit_depths"], controls)
    step_bytes = weights.per_token_step(loops)
    floor = floor_tokens_per_s(r["concurrency"], step_bytes, bandwidth) if bandwidth else None
    rate = r["decode_tokens_per_s_median"]
    return {
        "concurrency": r["concurrency"],
        "decode_tokens_per_s": rate,
        "decode_tokens_per_s_all": r["decode_tokens_per_s_all"],
        # the tokens committed while the clock ran, and their rate (run_once's docstring)
        "window_tokens": r["window_tokens_median"],
        "window_tokens_per_s": r["window_tokens_per_s_median"],
        "ttft_ms_p50": r["ttft_ms_p50"],
        "ttft_ms_p90": r["ttft_ms_p90"],
        "tpot_ms_p50": r["tpot_ms_p50"],
        "e2e_ms_p50": r["e2e_ms_p50"],
        "steps_per_run": r["steps_per_run"],
        # CUDA graphs captured on first use during the measured runs (0 after a full warm-up)
        "graphs_captured": r["graphs_captured_in_runs"],
        "graph_capture_s": r["graph_capture_s_in_runs"],
        "exit_depths": {str(d): r["exit_depths"].get(d, 0) for d in range(1, depth + 1)},
        "memory_start_bytes": r.get("memory_start_bytes"),
        "peak_memory_bytes": r.get("peak_memory_bytes"),
        "floor_loops": loops,
        "bytes_per_token_step": step_bytes,
        "floor_tokens_per_s": floor,
        "floor_share": rate / floor if floor else None,
    }


# -- rendering ----------------------------------------------------------------------------
def execution_text(report: dict[str, Any]) -> str:
    graphs = "CUDA graphs" if report["cuda_graphs"] else "eager"
    if report.get("graphs_at_start"):
        n, seconds = report["graphs_at_start"], report["graph_capture_s_at_start"]
        graphs += f" ({n} captured at start-up in {seconds:.1f} s)"
    if report["enforce_eager"]:
        graphs += " (--enforce-eager)"
    backend = report["attention_impl"] or report["attention_backend"]
    if report["attention_backend"] == "auto":
        backend += " (auto)"
    text = f"attention {backend}, {graphs}, decode window {report['decode_window']}"
    kernels = report.get("kernels") or {}
    live = [name for name in ("pdl", "fused_rows") if kernels.get(name)]
    if kernels.get("small_gemm", "cublas") != "cublas":
        tuned_on = kernels.get("small_gemm_table")  # whose table: another GPU of the layout's
        whose = f" ({tuned_on}'s)" if tuned_on else ""
        live.append(f"small GEMMs: {kernels['small_gemm']}{whose}")
    return text + (f", {', '.join(live)}" if live else "")


def _table(report: dict[str, Any]) -> Table:
    depth = report["num_loops"]
    bw = report["bandwidth_gbs"]
    floor_note = (
        f"floor: weight-bandwidth floor at {bw:,.0f} GB/s ({report['bandwidth_source']}), "
        f"{report['weight_bytes']['per_token_step_at_full_depth'] / 1e9:.3g} GB per token "
        f"step at depth {depth}"
        if bw
        else "floor: n/a (no CUDA; give --bandwidth-gbs)"
    )
    caption = (
        f"{report['model']} ({report['device_name']}, {report['dtype']}; "
        f"{execution_text(report)}; max {report['max_num_seqs']} seqs): "
        f"{report['prompt_len']}-token prompts, {report['output_len']} output tokens, "
        f"{_loops(report)}. "
        f"tok/s: committed decode tokens/s, median of {report['repeats']} run(s) "
        f"(first token and prefill excluded). {floor_note}. peak: max GPU memory allocated. "
        f"dK: output tokens by exit depth K, K = 1..{depth}"
    )
    late = [r for r in report["results"] if r["graphs_captured"]]
    if late:  # a capture stalls every request in flight: those runs are slower than serving
        caption += ". CUDA graphs captured while measuring: " + ", ".join(
            f"c={r['concurrency']}: {r['graphs_captured']} ({r['graph_capture_s']:.2f} s)"
            for r in late
        )
    table = Table(caption=caption, caption_justify="left", box=None, pad_edge=False)
    columns = ("concurrency", "tok/s", "floor", "% floor", "TTFT p50", "TTFT p90", "TPOT p50")
    for name in (*columns, "E2E p50", "peak"):
        table.add_column(name, justify="right")
    for d in range(1, depth + 1):
        table.add_column(f"d{d}", justify="right")
    for r in report["results"]:
        floor, share = r["floor_tokens_per_s"], r["floor_share"]
        cells = [
            str(r["concurrency"]),
            f"{r['decode_tokens_per_s']:.1f}",
            f"{floor:,.0f}" if floor else "n/a",
            f"{100 * share:.1f}%" if share is not None else "n/a",
        ]
        cells += [_ms(r[k]) for k in ("ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "e2e_ms_p50")]
        peak = r["peak_memory_bytes"]
        cells.append(f"{peak / 2**30:.2f} GiB" if peak is not None else "n/a")
        counts = [r["exit_depths"][str(d)] for d in range(1, depth + 1)]
        table.add_row(*cells, *(str(n) if n else "[dim]0[/]" for n in counts))
    return table


def _serving_table(report: dict[str, Any]) -> Table:
    rate = report["request_rate"]
    limit = report["max_concurrency"]
    prompts = (
        f"{report['input_len']}-token random prompts"
        if report["dataset"] == "random"
        else f"gsm8k questions ({report['dataset_path']})"
    )
    extra = "".join(f", {k} {v}" for k, v in report["extra_body"].items())
    caption = (
        f"{report['url']} ({report['model']}): {report['num_prompts']} requests, {prompts}, "
        f"{report['output_len']} output tokens (ignore_eos, greedy){extra}; "
        f"rate {'inf (all at once)' if rate == 'inf' else f'{rate:g} req/s (Poisson)'}, "
        f"max concurrency {limit if limit is not None else 'unlimited'}. "
        f"Completed {report['completed']}, failed {report['failed']} in "
        f"{report['duration_s']:.2f} s: {report['request_throughput']:.2f} req/s, "
        f"{report['output_throughput']:,.1f} output tok/s, "
        f"{report['total_token_throughput']:,.1f} total tok/s "
        f"({report['total_input_tokens']:,} in, {report['total_output_tokens']:,} out). "
        "TPOT: (E2E - TTFT) / (tokens - 1) per request; ITL: per token"
        + (
            f" ({report['tokens_per_chunk']:.2f} tokens per streamed chunk)"
            if report["tokens_per_chunk"]
            else ""
        )
    )
    table = Table(caption=caption, caption_justify="left", box=None, pad_edge=False)
    table.add_column("latency")
    for name in ("mean", "median", "p99"):
        table.add_column(name, justify="right")
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E"),
    ):
        stats = report[key]
        table.add_row(name, *(_latency(stats[q]) for q in ("mean", "median", "p99")))
    return table


def _latency(ms: float | None) -> str:
    if ms is None:
        return "n/a"
    return f"{ms:.2f} ms" if ms < 100 else _ms(ms)


def _loops(report: dict[str, Any]) -> str:
    lo, hi = report["min_loops"], report["max_loops"]
    if report["exit_threshold"] >= 1:
        return f"fixed depth {hi}"
    return f"exit threshold {report['exit_threshold']:g}, {lo}..{hi} loops"


def _ms(value: float) -> str:
    return f"{value:.1f} ms" if value < 1000 else f"{value / 1000:.2f} s"
