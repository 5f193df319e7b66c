"""`rlt bench`: offline, in-process decode benchmark (DESIGN.md §9) over several batch sizes.

Random token-id prompts (seeded), so tokenizer-less dummy models work too. Per concurrency:
committed decode tokens/s (median over repeats, rlt_engine/bench/throughput.py), TTFT p50/p90,
TPOT p50, E2E p50 and the exit-depth histogram of every output token. Human output: a table on
stdout, notices and progress on stderr. `--json`: one JSON object on stdout, nothing else.
The engine flags are those of `rlt generate` (rlt_cli/options.py). torch loads only when run.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from rlt_cli.command import callback, keyword
from rlt_cli.options import engine_fields, engine_parameters, to_field_values
from rlt_cli.output import check_device, status_spinner, stderr, stdout
from rlt_engine.config import EngineConfig
from rlt_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rlt_engine.llm import LLM

HELP = "Benchmark offline decode throughput and latency (tok/s, TTFT, TPOT) in-process."
DEFAULT_CONCURRENCY = (1, 8)


@dataclass(frozen=True)
class BenchRun:
    engine_options: dict[str, Any]
    concurrency: tuple[int, ...]
    prompt_len: int
    output_len: int
    repeats: int
    warmup: int
    params: SamplingParams  # loop controls; greedy, ignore_eos, max_tokens = output_len
    json_output: bool


def bench_command() -> Callable[..., None]:
    """The Typer callback: the engine flags are built from the config dataclasses."""
    parameters = [*_WORKLOAD, *engine_parameters(), *_LOOPS, *_FRONT_END]
    return callback(lambda values: _bench(_parse(values)), parameters, HELP)


def _option(name: str, kind: type, default: Any, help: str, panel: str) -> inspect.Parameter:
    flag = typer.Option("--" + name.replace("_", "-"), help=help, rich_help_panel=panel)
    return keyword(name, Annotated[kind, flag], default)


_WORKLOAD = [
    keyword(
        "concurrency",
        Annotated[
            list[int] | None,
            typer.Option(
                "--concurrency",
                "-c",
                help="Requests run at once (repeatable; default: 1 and 8).",
                rich_help_panel="Workload",
            ),
        ],
        None,
    ),
    _option("prompt_len", int, 64, "Prompt tokens per request (random ids).", "Workload"),
    _option("output_len", int, 32, "Output tokens per request (ignore_eos), >= 2.", "Workload"),
    _option("repeats", int, 3, "Measured runs per concurrency (median reported).", "Workload"),
    _option("warmup", int, 1, "Discarded runs per concurrency before measuring.", "Workload"),
]
_LOOPS = [
    _option(
        "exit_threshold",
        float,
        1.0,
        "Exit once the gate's cumulative exit probability reaches this, in 0..1; 1 = fixed depth.",
        "Loop controls",
    ),
    _option("min_loops", int | None, None, "Least loops per token (default 1).", "Loop controls"),
    _option(
        "max_loops",
        int | None,
        None,
        "Most loops per token (default: the model depth).",
        "Loop controls",
    ),
]
_FRONT_END = [
    keyword(
        "json_output",
        Annotated[bool, typer.Option("--json", help="Print one JSON object; no table.")],
        False,
    ),
]


# -- parsing and validation (no torch) ----------------------------------------------------
def _parse(values: dict[str, Any]) -> BenchRun:
    engine_options = to_field_values(values, [f.name for f in engine_fields()])
    config = EngineConfig.from_options(**dict(engine_options))  # fail fast, before torch
    concurrency = tuple(values["concurrency"] or DEFAULT_CONCURRENCY)
    for c in concurrency:
        if c < 1:
            raise ValueError(f"--concurrency must be >= 1, got {c}")
    max_seqs = config.scheduler.max_num_seqs
    if max(concurrency) > max_seqs:
        raise ValueError(
            f"--concurrency {max(concurrency)} exceeds --max-num-seqs {max_seqs}: the requests "
            "would not all run at once"
        )
    for name, least in (("prompt_len", 1), ("output_len", 2), ("repeats", 1), ("warmup", 0)):
        if values[name] < least:
            flag = "--" + name.replace("_", "-")
            why = " (decode time starts after the first token)" if name == "output_len" else ""
            raise ValueError(f"{flag} must be >= {least}{why}, got {values[name]}")
    params = SamplingParams(
        max_tokens=values["output_len"],
        ignore_eos=True,
        min_loops=values["min_loops"],
        max_loops=values["max_loops"],
        exit_threshold=values["exit_threshold"],
    )
    lo, hi = params.min_loops, params.max_loops
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"min_loops ({lo}) must be <= max_loops ({hi})")
    return BenchRun(
        engine_options=engine_options,
        concurrency=tuple(dict.fromkeys(concurrency)),  # in order, without repeats
        prompt_len=values["prompt_len"],
        output_len=values["output_len"],
        repeats=values["repeats"],
        warmup=values["warmup"],
        params=params,
        json_output=values["json_output"],
    )


# -- running ------------------------------------------------------------------------------
def _bench(run: BenchRun) -> None:
    check_device(run.engine_options.get("device", "auto"))
    from rlt_engine.bench.throughput import benchmark
    from rlt_engine.core.exit_rule import LoopControls
    from rlt_engine.llm import LLM

    with status_spinner("loading model"):
        llm = LLM(**run.engine_options)
    engine = llm.engine
    if engine.notice:
        stderr.print(f"[dim]{escape(engine.notice)}[/]")
    depth = engine.model_config.num_loops
    p = run.params
    LoopControls(
        min_loops=p.min_loops if p.min_loops is not None else 1,
        max_loops=p.max_loops if p.max_loops is not None else depth,
        exit_threshold=p.exit_threshold if p.exit_threshold is not None else 1.0,
    ).validate(depth)
    context = engine.model_config.max_position_embeddings
    if run.prompt_len + run.output_len > context:
        raise ValueError(
            f"--prompt-len {run.prompt_len} + --output-len {run.output_len} exceeds the "
            f"model's context of {context} positions"
        )

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
                p,
                on_run,
                seed=10_000 * c,
            )
            results.append(_result(r, depth))

    report = _report(llm, run, results)
    if run.json_output:
        typer.echo(json.dumps(report))
        return
    stdout.print(_table(report))


def _result(r: dict[str, Any], depth: int) -> dict[str, Any]:
    return {
        "concurrency": r["concurrency"],
        "decode_tokens_per_s": r["decode_tokens_per_s_median"],
        "decode_tokens_per_s_all": r["decode_tokens_per_s_all"],
        "ttft_ms_p50": r["ttft_ms_p50"],
        "ttft_ms_p90": r["ttft_ms_p90"],
        "tpot_ms_p50": r["tpot_ms_p50"],
        "e2e_ms_p50": r["e2e_ms_p50"],
        "steps_per_run": r["steps_per_run"],
        "exit_depths": {str(d): r["exit_depths"].get(d, 0) for d in range(1, depth + 1)},
    }


def _report(llm: LLM, run: BenchRun, results: list[dict[str, Any]]) -> dict[str, Any]:
    engine = llm.engine
    p = run.params
    return {
        "model": str(engine.model_dir),
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "num_loops": engine.model_config.num_loops,
        "num_blocks": engine.num_blocks,
        "prompt_len": run.prompt_len,
        "output_len": run.output_len,
        "repeats": run.repeats,
        "warmup": run.warmup,
        "min_loops": p.min_loops,
        "max_loops": p.max_loops,
        "exit_threshold": p.exit_threshold,
        "results": results,
    }


# -- rendering ----------------------------------------------------------------------------
def _table(report: dict[str, Any]) -> Table:
    depth = report["num_loops"]
    caption = (
        f"{report['model']} ({report['device']}, {report['dtype']}): "
        f"{report['prompt_len']}-token prompts, {report['output_len']} output tokens, "
        f"{_loops(report)}. "
        f"tok/s: committed decode tokens/s, median of {report['repeats']} run(s) "
        f"(first token and prefill excluded). dK: output tokens by exit depth K, "
        f"K = 1..{depth}"
    )
    table = Table(caption=caption, caption_justify="left", box=None, pad_edge=False)
    for name in ("concurrency", "tok/s", "TTFT p50", "TTFT p90", "TPOT p50", "E2E p50"):
        table.add_column(name, justify="right")
    for d in range(1, depth + 1):
        table.add_column(f"d{d}", justify="right")
    for r in report["results"]:
        cells = [str(r["concurrency"]), f"{r['decode_tokens_per_s']:.1f}"]
        cells += [_ms(r[k]) for k in ("ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "e2e_ms_p50")]
        counts = [r["exit_depths"][str(d)] for d in range(1, depth + 1)]
        table.add_row(*cells, *(str(n) if n else "[dim]0[/]" for n in counts))
    return table


def _loops(report: dict[str, Any]) -> str:
    lo, hi = report["min_loops"] or 1, report["max_loops"] or report["num_loops"]
    if report["exit_threshold"] >= 1:
        return f"fixed depth {hi}"
    return f"exit threshold {report['exit_threshold']:g}, {lo}..{hi} loops"


def _ms(value: float) -> str:
    return f"{value:.1f} ms" if value < 1000 else f"{value / 1000:.2f} s"
