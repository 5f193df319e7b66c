"""`rlt eval gsm8k`: lm-eval-compatible GSM8K accuracy across loop depths and exit thresholds in
one run, in-process or against an OpenAI-compatible server (`--url`). docs/eval.md.

Everything that needs no model (flags, data, prompts, the output directory, matplotlib for
`--plot`) is checked before the model loads. Human output: a live view on stderr, the final
table on stdout; `--json`: one JSON object on stdout, nothing else.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from rlt_cli.command import callback, keyword
from rlt_cli.engine import load_llm
from rlt_cli.options import engine_fields, engine_parameters, flag_name, to_field_values
from rlt_cli.output import check_device, print_table, status_spinner, stderr
from rlt_engine.config import EngineConfig, KVLayout

if TYPE_CHECKING:
    from rlt_engine.eval.backends import Backend
    from rlt_engine.eval.data import Doc
    from rlt_engine.eval.runner import EvalConfig

HELP = (
    "Evaluate GSM8K accuracy as lm-eval 0.4.x scores it (gsm8k_cot 3-shot by default, or gsm8k "
    "5-shot) across --loops x --exit-threshold in one run, in-process or against --url. Every "
    "engine flag of `rlt generate` applies."
)
BENCHMARKS = ("gsm8k",)
PANEL = "Evaluation"


def _option(name: str, annotation: Any, default: Any, *flags: str, **kwargs: Any) -> Any:
    option = typer.Option(*flags, rich_help_panel=PANEL, **kwargs)
    return keyword(name, Annotated[annotation, option], default)


_BENCHMARK = keyword(
    "benchmark",
    Annotated[
        str,
        typer.Argument(metavar="BENCHMARK", show_default=False, help="gsm8k (the only one yet)."),
    ],
)
_OPTIONS = [
    _option(
        "task",
        str,
        "gsm8k_cot",
        "--task",
        help="gsm8k_cot: lm-eval's 8 chain-of-thought exemplars, 'The answer is N'; gsm8k: "
        "lm-eval's 5-shot Question/Answer drawn from the train split, '#### N'.",
    ),
    _option(
        "num_fewshot",
        int | None,
        None,
        "--num-fewshot",
        help="Few-shot examples (gsm8k_cot: the first n of 8, default 3 as Ouro reports; "
        "gsm8k: default 5).",
    ),
    _option(
        "data",
        Path | None,
        None,
        "--data",
        metavar="FILE",
        help='Test problems as JSONL of {"question", "answer"} (default: openai/gsm8k test '
        "through `datasets`).",
    ),
    _option(
        "fewshot_data",
        Path | None,
        None,
        "--fewshot-data",
        metavar="FILE",
        help="Train problems for gsm8k's few-shot draws, JSONL (default: openai/gsm8k train "
        "through `datasets`; lm-eval's draws need the full 7,473-problem split).",
    ),
    _option("limit", int | None, None, "--limit", help="Evaluate the first N problems only."),
    _option(
        "loops",
        str | None,
        None,
        "--loops",
        metavar="LIST",
        help="Loop depths to sweep (max_loops), e.g. 1,2,3,4 (default: the model's depth).",
    ),
    _option(
        "exit_threshold",
        str | None,
        None,
        "--exit-threshold",
        metavar="LIST",
        help="Exit thresholds to sweep, e.g. 0.5,0.7,0.9,1.0; 1 = fixed depth (default: the "
        "model config's).",
    ),
    _option(
        "chat",
        bool,
        False,
        "--chat",
        help="Send each prompt as one user message through the chat template; the answer is "
        "read after </think> when there is one (Thinking models).",
    ),
    _option(
        "max_tokens",
        int | None,
        None,
        "--max-tokens",
        help="Most tokens per answer (default 256, lm-eval's max_gen_toks).",
    ),
    _option("temperature", float, 0.0, "--temperature", help="Sampling temperature; 0 = greedy."),
    _option("seed", int | None, None, "--seed", help="Per-request sampling seed."),
    _option(
        "fewshot_seed",
        int,
        1234,
        "--fewshot-seed",
        help="Seed of gsm8k's few-shot draws (lm-eval's --fewshot_random_seed default).",
    ),
    _option(
        "url",
        str | None,
        None,
        "--url",
        help="Evaluate a running OpenAI-compatible server (e.g. `rlt serve`) instead of an "
        "in-process engine; --model then names the served model (default: its first).",
    ),
    _option(
        "api_key",
        str | None,
        None,
        "--api-key",
        help="With --url: bearer token (default: $RLT_API_KEY, else $OPENAI_API_KEY).",
    ),
    _option("concurrency", int, 16, "--concurrency", help="With --url: requests in flight."),
    _option(
        "output_dir",
        Path | None,
        None,
        "--output-dir",
        metavar="DIR",
        help="Write run.json and one JSONL per setting (a record per question) here.",
    ),
    _option(
        "resume",
        bool,
        False,
        "--resume",
        help="Continue the run in --output-dir: questions already recorded are not run again.",
    ),
    _option("json_output", bool, False, "--json", help="Print the summary as one JSON object."),
    _option(
        "plot",
        Path | None,
        None,
        "--plot",
        metavar="FILE.png",
        help="Plot accuracy against mean loops per token (needs matplotlib, the `plot` extra).",
    ),
]
_EVAL_NAMES = [p.name for p in _OPTIONS]


@dataclass(frozen=True)
class EvalRun:
    config: EvalConfig
    docs: list[Doc]
    prompts: list[str]
    engine_options: dict[str, Any]
    url: str | None
    api_key: str | None
    concurrency: int
    json_output: bool
    plot: Path | None


def eval_command() -> Callable[..., None]:
    parameters = [_BENCHMARK, *_OPTIONS, *engine_parameters()]
    return callback(lambda values: _evaluate(_parse(values)), parameters, HELP)


# -- parsing and validation (no torch) ----------------------------------------------------
def parse_list(text: str | None, flag: str, kind: type) -> list[Any]:
    """`1,2,4` -> [1, 2, 4]; None -> [None] (the model's default)."""
    if text is None:
        return [None]
    items = [item.strip() for item in text.split(",")]
    try:
        values = [kind(item) for item in items]
    except ValueError:
        raise ValueError(f"{flag} {text}: expected comma-separated numbers") from None
    if not values:
        raise ValueError(f"{flag}: give at least one value")
    if len(set(values)) != len(values):
        raise ValueError(f"{flag} {text}: a value is repeated")
    if kind is int and any(v < 1 for v in values):
        raise ValueError(f"{flag} {text}: loop depths must be >= 1")
    if kind is float and any(not 0.0 <= v <= 1.0 for v in values):
        raise ValueError(f"{flag} {text}: exit thresholds must lie in [0, 1]")
    return values


def _parse(values: dict[str, Any]) -> EvalRun:
    from rlt_engine.eval.gsm8k import get_task
    from rlt_engine.eval.results import Setting
    from rlt_engine.eval.runner import EvalConfig, build_prompts

    if values["benchmark"] not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {values['benchmark']!r} (choose from gsm8k)")
    task = get_task(values["task"])
    for name in ("limit", "max_tokens", "concurrency"):
        if values[name] is not None and values[name] < 1:
            raise ValueError(f"{flag_name(name)} must be >= 1, got {values[name]}")
    if values["temperature"] < 0:
        raise ValueError(f"--temperature must be >= 0, got {values['temperature']}")
    if values["resume"] and values["output_dir"] is None:
        raise ValueError("--resume continues the run in --output-dir: give --output-dir DIR")
    if values["url"] is None and values["api_key"] is not None:
        raise ValueError("--api-key goes with --url")
    loops = parse_list(values["loops"], "--loops", int)
    thresholds = parse_list(values["exit_threshold"], "--exit-threshold", float)
    engine_options = to_field_values(values, [f.name for f in engine_fields()])
    if values["url"] is not None:
        _check_no_engine_flags(engine_options)
    else:
        engine_options = _engine_options(engine_options)
    if values["plot"] is not None:
        from rlt_engine.eval.plot import require_matplotlib

        require_matplotlib()
    num_fewshot = values["num_fewshot"]
    config = EvalConfig(
        task=task,
        num_fewshot=task.default_num_fewshot if num_fewshot is None else num_fewshot,
        settings=tuple(Setting(n, t) for n in loops for t in thresholds),
        limit=values["limit"],
        chat=values["chat"],
        max_tokens=values["max_tokens"],
        temperature=values["temperature"],
        seed=values["seed"],
        fewshot_seed=values["fewshot_seed"],
        output_dir=values["output_dir"],
        resume=values["resume"],
    )
    docs, train = _load(config, values["data"], values["fewshot_data"])
    docs, prompts = build_prompts(config, docs, train)
    return EvalRun(
        config=config,
        docs=docs,
        prompts=prompts,
        engine_options=engine_options,
        url=values["url"],
        api_key=values["api_key"],
        concurrency=values["concurrency"],
        json_output=values["json_output"],
        plot=values["plot"],
    )


def _engine_options(options: dict[str, Any]) -> dict[str, Any]:
    """The user's engine options, with prefix caching on wherever the layout has it (the
    sweep's settings share every prompt's KV)."""
    config = EngineConfig.from_options(**options)  # fail fast, before torch is imported
    if config.cache.kv_layout is KVLayout.LAST_EXITED:
        options = {**options, "enable_prefix_caching": True}
    return options


def _check_no_engine_flags(options: dict[str, Any]) -> None:
    defaults = {f.name: f.default for f in engine_fields() if f.default is not MISSING}
    for name, value in options.items():
        if name != "model" and value != defaults.get(name):
            raise ValueError(
                f"{flag_name(name)} does not apply with --url (the server's engine is set by its "
                "own flags)"
            )


def _load(
    config: EvalConfig, data: Path | None, fewshot_data: Path | None
) -> tuple[list[Doc], list[Doc] | None]:
    from rlt_engine.eval.data import load_docs

    with status_spinner("loading GSM8K"):
        docs = load_docs("test", data, "--data")
        train = None
        if config.task.uses_train_split and config.num_fewshot > 0:
            if fewshot_data is None and data is not None:
                raise ValueError(
                    f"{config.task.name} draws its few-shot examples from the train split: with "
                    "--data, also pass --fewshot-data TRAIN.jsonl"
                )
            train = load_docs("train", fewshot_data, "--fewshot-data")
    if config.limit is not None and config.limit > len(docs):
        raise ValueError(f"--limit {config.limit}: the data has {len(docs)} problems")
    return docs, train


# -- running ------------------------------------------------------------------------------
def _evaluate(run: EvalRun) -> None:
    from rlt_engine.eval.report import LiveView, final_table, summary
    from rlt_engine.eval.runner import new_results, run_sweep

    backend = _backend(run)
    try:
        results = new_results(run.config, len(run.docs))
        title = _title(run, backend.description)
        with LiveView(results, stderr, title, enabled=not run.json_output) as view:
            run_sweep(run.config, run.docs, run.prompts, backend, results, view)
    finally:
        backend.close()
    plot = None
    if run.plot is not None:
        from rlt_engine.eval.plot import write_plot

        plot = str(write_plot(results, run.plot, title))
    meta = _meta(run, backend.description, plot)
    if run.config.output_dir is not None:
        (run.config.output_dir / "summary.json").write_text(
            json.dumps(summary(results, meta), indent=2) + "\n", encoding="utf-8"
        )
    if run.json_output:
        typer.echo(json.dumps(summary(results, meta)))
        return
    print_table(final_table(results, caption=_caption(title)))
    if run.config.output_dir is not None:
        stderr.print(f"[dim]per-question records: {escape(str(run.config.output_dir))}[/]")
    if plot:
        stderr.print(f"[dim]plot: {escape(plot)}[/]")


def _backend(run: EvalRun) -> Backend:
    from rlt_engine.eval.backends import HTTPBackend, InProcessBackend

    if run.url is not None:
        model = run.engine_options.get("model")
        return HTTPBackend(run.url, model, run.config.chat, run.concurrency, run.api_key)
    check_device(run.engine_options.get("device", "auto"))
    llm = load_llm(run.engine_options)
    if llm.info.notice and not run.json_output:
        stderr.print(f"[dim]{escape(llm.info.notice)}[/]")
    if llm.tokenizer is None:
        raise ValueError(f"{llm.info.model_dir} has no tokenizer, which text prompts need")
    depth = llm.info.num_loops
    deep = [s.max_loops for s in run.config.settings if (s.max_loops or 0) > depth]
    if deep:
        raise ValueError(f"--loops {deep[0]}: the model runs at most {depth} loops")
    return InProcessBackend(llm, run.config.chat)


def _title(run: EvalRun, evaluated: str) -> str:
    config = run.config
    chat = ", chat" if config.chat else ""
    return (
        f"{config.task.name}, {config.num_fewshot}-shot{chat}, {len(run.docs)} questions: "
        f"{evaluated}"
    )


def _caption(title: str) -> str:
    return (
        f"{title}. Scored as lm-eval 0.4.x; accuracy [95% Wilson score interval]; loops/token: "
        "mean exit depth of the output tokens; tok/s: output tokens generated in this run per "
        "second of the setting's wall time."
    )


def _meta(run: EvalRun, evaluated: str, plot: str | None) -> dict[str, Any]:
    from rlt_engine.eval.gsm8k import LM_EVAL_VERSION

    config = run.config
    return {
        "task": config.task.name,
        "num_fewshot": config.num_fewshot,
        "chat": config.chat,
        "model": evaluated,
        "url": run.url,
        "questions": len(run.docs),
        "max_tokens": config.max_tokens or config.task.max_gen_toks,
        "temperature": config.temperature,
        "scoring": LM_EVAL_VERSION,
        "filters": config.task.filter_names,
        "output_dir": os.fspath(config.output_dir) if config.output_dir else None,
        "plot": plot,
    }
