"""`rlt generate`: run prompts as one batch, stream the text, then summarize speed and exit depths.

The flags come from the engine's config dataclasses and `SamplingParams` (rlt_cli/options.py).
Human output: generated text on stdout, notices and the summary table on stderr (so
`rlt generate ... > out.txt` keeps only text). `--json`: one JSON object on stdout, nothing else.
Prompts come from the arguments, `-` (all of stdin is one prompt) and `--prompt-file` (one prompt
per line, or JSONL of {"prompt": ...} objects), so long prompts need not fit the command line.
Everything that needs no model (flags, prompts) is checked before the model loads.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from rlt_cli.command import callback, keyword
from rlt_cli.engine import load_llm
from rlt_cli.options import (
    engine_fields,
    engine_parameters,
    sampling_fields,
    sampling_parameters,
    to_field_values,
)
from rlt_cli.output import check_device, one_line, status_spinner, stderr, stdout, stream_text
from rlt_engine.config import EngineConfig
from rlt_engine.sampling_params import SamplingParams, StructuredOutput

if TYPE_CHECKING:
    from rlt_engine.llm import LLM
    from rlt_engine.outputs import RequestOutput

HELP = "Generate text for prompts with a looped model (several prompts run as one batch)."


@dataclass(frozen=True)
class GenerateRun:
    prompts: list[str]
    engine_options: dict[str, Any]
    params: SamplingParams
    chat: bool
    json_output: bool
    verbose: bool


def generate_command() -> Callable[..., None]:
    """The Typer callback: its signature is built from the config dataclasses."""
    parameters = [
        _PROMPTS,
        _PROMPT_FILE,
        *engine_parameters(),
        *sampling_parameters(),
        *_STRUCTURED,
        *_FRONT_END,
    ]
    return callback(lambda values: _generate(_parse(values)), parameters, HELP)


_PROMPTS = keyword(
    "prompts",
    Annotated[
        list[str] | None,
        typer.Argument(
            metavar="PROMPT",
            show_default=False,
            help="Prompts, run as one batch; `-` reads one prompt from stdin.",
        ),
    ],
    None,
)
_PROMPT_FILE = keyword(
    "prompt_file",
    Annotated[
        Path | None,
        typer.Option(
            "--prompt-file",
            metavar="FILE",
            help='Read prompts from FILE (`-`: stdin): one per line, or JSONL of {"prompt": ...}.',
        ),
    ],
    None,
)
_FRONT_END = [
    keyword(
        "chat",
        Annotated[bool, typer.Option("--chat", help="Send each prompt as a user chat message.")],
        False,
    ),
    keyword(
        "json_output",
        Annotated[bool, typer.Option("--json", help="Print one JSON object; no streaming.")],
        False,
    ),
    keyword(
        "verbose",
        Annotated[bool, typer.Option("--verbose", "-v", help="Print the resolved model setup.")],
        False,
    ),
]


def _structured_option(name: str, flag: str, kind: Any, help: str) -> Any:
    option = typer.Option(flag, help=help, rich_help_panel="Structured output")
    return keyword(name, Annotated[kind, option], None if kind is not bool else False)


# SamplingParams.structured: one of these (a TEXT that starts with @ names a file to read)
_STRUCTURED = [
    _structured_option("json_schema", "--json-schema", str | None, "A JSON schema (or @FILE)."),
    _structured_option("json_object", "--json-object", bool, "Any JSON object."),
    _structured_option("regex", "--regex", str | None, "A regular expression."),
    _structured_option("choice", "--choice", list[str] | None, "One of these (repeatable)."),
    _structured_option("grammar", "--grammar", str | None, "An EBNF grammar, root rule `root` "
                       "(or @FILE)."),
]  # fmt: skip


def _structured(values: dict[str, Any]) -> StructuredOutput | None:
    given = {
        name: values[name]
        for name in ("json_schema", "json_object", "regex", "choice", "grammar")
        if values[name]
    }
    if not given:
        return None
    if len(given) > 1:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(f"give one kind of structured output, got {flags}")
    ((name, value),) = given.items()
    if name in ("json_schema", "grammar") and value.startswith("@"):
        try:
            value = Path(value[1:]).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(
                f"--{name.replace('_', '-')}: cannot read {value[1:]}: {exc}"
            ) from None
    if name == "json_schema":
        try:
            json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--json-schema is not JSON: {exc}") from None
        return StructuredOutput(json=value)
    return StructuredOutput(**{name: value})


# -- parsing and validation (no torch) ----------------------------------------------------
def _parse(values: dict[str, Any]) -> GenerateRun:
    engine_options = to_field_values(values, [f.name for f in engine_fields()])
    EngineConfig.from_options(**engine_options)  # fail fast, before torch is imported
    params = SamplingParams(
        **to_field_values(values, [f.name for f in sampling_fields()]),
        structured=_structured(values),
    )
    lo, hi = params.min_loops, params.max_loops
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"min_loops ({lo}) must be <= max_loops ({hi})")
    return GenerateRun(
        prompts=read_prompts(values["prompts"] or [], values["prompt_file"]),
        engine_options=engine_options,
        params=params,
        chat=values["chat"],
        json_output=values["json_output"],
        verbose=values["verbose"],
    )


def read_prompts(arguments: list[str], prompt_file: Path | None) -> list[str]:
    """The prompts of the arguments (`-`: stdin as one prompt), then those of `prompt_file`;
    at least one, none empty."""
    prompts: list[str] = []
    stdin_used = False
    for i, prompt in enumerate(arguments, start=1):
        if prompt == "-":
            if stdin_used:
                raise ValueError("`-` (stdin) can be given once")
            stdin_used = True
            prompt = _strip_newline(sys.stdin.read())
            if not prompt:
                raise ValueError("the prompt read from stdin (`-`) is empty")
        elif not prompt:
            raise ValueError(f"prompt {i} is empty")
        prompts.append(prompt)
    if prompt_file is not None:
        if str(prompt_file) == "-" and stdin_used:
            raise ValueError("`-` and --prompt-file - both read stdin; give one of them")
        prompts += _file_prompts(prompt_file)
    if not prompts:
        raise ValueError("no prompt given: pass PROMPT, `-` for stdin, or --prompt-file FILE")
    return prompts


def _strip_newline(text: str) -> str:
    return text[:-1] if text.endswith("\n") else text


def _file_prompts(path: Path) -> list[str]:
    """One prompt per non-blank line; a file whose every line is a JSON object is JSONL, each
    object's "prompt" (a string) one prompt."""
    name = "stdin" if str(path) == "-" else str(path)
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--prompt-file {name}: cannot read it ({one_line(str(exc))})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise ValueError(f"--prompt-file {name} holds no prompt")
    if not all(line.lstrip().startswith("{") for _, line in lines):
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--prompt-file {name} line {n}: not valid JSON ({exc.msg})") from None
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(prompt, str):
            raise ValueError(f'--prompt-file {name} line {n}: needs a "prompt" string')
        if not prompt:
            raise ValueError(f"--prompt-file {name} line {n}: the prompt is empty")
        prompts.append(prompt)
    return prompts


# -- running ------------------------------------------------------------------------------
def _generate(run: GenerateRun) -> None:
    check_device(run.engine_options.get("device", "auto"))
    llm = load_llm(run.engine_options)
    if llm.info.notice:
        stderr.print(f"[dim]{escape(llm.info.notice)}[/]")
    if run.verbose:
        _print_setup(llm)
    _check_tokenizer(llm, run.params)

    stream = _Stream(len(run.prompts), live_text=not run.json_output and len(run.prompts) == 1)
    start = time.perf_counter()
    with status_spinner(stream.describe()) as status:
        stream.status = status
        outputs = _call(llm, run, stream.on_output)
    wall = time.perf_counter() - start

    if run.json_output:
        typer.echo(json.dumps(_json_result(llm, run.prompts, outputs)))
        return
    if not stream.live_text:
        _print_completions(run.prompts, outputs)
    stderr.print()
    stderr.print(_summary(outputs, llm.info.num_loops, wall, run.params))
    if run.verbose:
        stats = llm.engine.cache_stats()
        stderr.print(
            f"[dim]prefix cache: {stats['prefix_hit_blocks']}/{stats['prefix_queried_blocks']} "
            f"blocks reused; preemptions: {stats['preemptions']}[/]"
        )


def _call(
    llm: LLM, run: GenerateRun, on_output: Callable[[RequestOutput], None]
) -> list[RequestOutput]:
    if run.chat:
        conversations = [[{"role": "user", "content": p}] for p in run.prompts]
        return llm.chat(conversations, run.params, on_output=on_output)
    return llm.generate(run.prompts, run.params, on_output=on_output)


def _check_tokenizer(llm: LLM, params: SamplingParams) -> None:
    if llm.tokenizer is not None:
        return
    what = "--stop strings" if params.stop else "text prompts"
    raise ValueError(f"{llm.info.model_dir} has no tokenizer, which {what} need")


class _Stream:
    """Streams one prompt's text to stdout; for a batch, counts progress on the spinner."""

    def __init__(self, num_prompts: int, *, live_text: bool) -> None:
        self.num_prompts = num_prompts
        self.live_text = live_text
        self.status: Any = None
        self._tokens: dict[str, int] = {}
        self._finished = 0

    def describe(self) -> str:
        if self.live_text:
            return "prefill"
        done, tokens = self._finished, sum(self._tokens.values())
        return f"generating: {done}/{self.num_prompts} prompts done, {tokens} tokens"

    def on_output(self, out: RequestOutput) -> None:
        self._tokens[out.request_id] = out.num_tokens
        self._finished += out.finished
        if self.live_text:
            if self.status is not None:
                self.status.stop()  # the spinner and the text would share the terminal
                self.status = None
            stream_text(out.new_text + ("\n" if out.finished else ""))
        elif self.status is not None:
            self.status.update(self.describe())


# -- rendering ----------------------------------------------------------------------------
def _print_setup(llm: LLM) -> None:
    info = llm.info
    rows = {
        "model": info.model_dir,
        "device": info.device,
        "dtype": info.dtype,
        "loops": str(info.num_loops),
    }
    plan = info.kv_cache
    rows["kv cache"] = (
        f"{plan['kv_cache']} ({plan['source']}): {plan['num_blocks']} blocks of "
        f"{plan['block_size']} tokens, {plan['block']} each"
    )
    rows["kv layout"] = f"{plan['kv_layout']}, {plan['num_planes']} plane(s), {plan['per_token']}"
    rows["kv layout"] += f" per token, room for {plan['max_concurrent_tokens']} tokens"
    for key, value in rows.items():
        stderr.print(f"[dim]{key:>9}:[/] {escape(value)}")


def _print_completions(prompts: list[str], outputs: list[RequestOutput]) -> None:
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True), start=1):
        title = escape(f"[{i}/{len(prompts)}] {_shorten(prompt)}")
        stdout.rule(f"[dim]{title}[/]", align="left")
        stdout.out(out.text)


def _shorten(text: str, width: int = 60) -> str:
    text = one_line(text)
    return text if len(text) <= width else text[: width - 1] + "…"


def _summary(
    outputs: list[RequestOutput], depth: int, wall: float, params: SamplingParams
) -> Table:
    table = Table(
        caption=f"dK: output tokens by exit depth K (loops run), K = 1..{depth}",
        caption_justify="left",
        box=None,
        pad_edge=False,
    )
    for name in ("#", "prompt", "output", "finish", "tok/s", "TTFT"):
        table.add_column(name, justify="left" if name == "finish" else "right")
    if params.logprobs is not None:
        table.add_column("logprob", justify="right")
    if params.prompt_logprobs is not None:
        table.add_column("prompt logprob", justify="right")
    for d in range(1, depth + 1):
        table.add_column(f"d{d}", justify="right")
    for i, out in enumerate(outputs, start=1):
        table.add_row(*_summary_row(str(i), out, params), *_histogram([out], depth))
    if len(outputs) > 1:
        total_out = sum(len(o.token_ids) for o in outputs)
        cells = ["all", str(sum(len(o.prompt_token_ids) for o in outputs)), str(total_out)]
        cells += ["", f"{total_out / wall:.1f}" if wall > 0 else "-", ""]
        cells += [""] * ((params.logprobs is not None) + (params.prompt_logprobs is not None))
        table.add_row(*cells, *_histogram(outputs, depth), style="bold")
    return table


def _summary_row(label: str, out: RequestOutput, params: SamplingParams) -> list[str]:
    m = out.metrics
    elapsed = (m.finish_time - m.arrival_time) if m.finish_time is not None else 0.0
    speed = f"{len(out.token_ids) / elapsed:.1f}" if elapsed > 0 else "-"
    ttft = m.time_to_first_token
    row = [label, str(len(out.prompt_token_ids)), str(len(out.token_ids))]
    row += [out.finish_reason or "-", speed, _seconds(ttft) if ttft is not None else "-"]
    if params.logprobs is not None:
        chosen = [lp.logprob for lp in out.logprobs or ()]
        row.append(f"{sum(chosen) / len(chosen):.3f}" if chosen else "-")
    if params.prompt_logprobs is not None:  # the mean over the prompt's scored tokens
        scored = [lp.logprob for lp in out.prompt_logprobs or () if lp is not None]
        row.append(f"{sum(scored) / len(scored):.3f}" if scored else "-")
    return row


def _histogram(outputs: list[RequestOutput], depth: int) -> list[str]:
    counts = Counter(d for out in outputs for d in out.exit_depths)
    return [str(counts[d]) if counts[d] else "[dim]0[/]" for d in range(1, depth + 1)]


def _seconds(value: float) -> str:
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _json_result(llm: LLM, prompts: list[str], outputs: list[RequestOutput]) -> dict[str, Any]:
    return {
        "model": llm.info.model_dir,
        "num_loops": llm.info.num_loops,
        "outputs": [_json_output(p, out) for p, out in zip(prompts, outputs, strict=True)],
    }


def _json_output(prompt: str, out: RequestOutput) -> dict[str, Any]:
    result = {
        "request_id": out.request_id,
        "prompt": prompt,
        "prompt_token_ids": out.prompt_token_ids,
        "token_ids": out.token_ids,
        "text": out.text,
        "exit_depths": out.exit_depths,
        "finish_reason": out.finish_reason,
        "metrics": {
            **asdict(out.metrics),
            "time_to_first_token": out.metrics.time_to_first_token,
        },
    }
    if out.logprobs is not None:
        result["logprobs"] = [asdict(lp) for lp in out.logprobs]
    if out.prompt_logprobs is not None:
        result["prompt_logprobs"] = [lp and asdict(lp) for lp in out.prompt_logprobs]
    return result
