"""The sweep: every (loops x exit threshold) setting over the same questions, one setting after
another through one backend, so the prompts' KV (full-depth prefill, the same for every
setting) is computed once and served from the prefix cache after that.

Each finished answer is scored, written to the setting's JSONL (with `--output-dir`) and counted
at once; `Observer` is told, for the live view.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rlt_engine.eval.backends import Backend, Completion
from rlt_engine.eval.data import Doc
from rlt_engine.eval.gsm8k import FEWSHOT_SEED, LM_EVAL_VERSION, Task, after_reasoning
from rlt_engine.eval.records import RecordWriter, check_output_dir, read_records
from rlt_engine.eval.results import Setting, SettingResult
from rlt_engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class EvalConfig:
    task: Task
    num_fewshot: int
    settings: tuple[Setting, ...]
    limit: int | None = None
    chat: bool = False
    max_tokens: int | None = None  # None: the task's (lm-eval's max_gen_toks, 256)
    temperature: float = 0.0  # greedy, as lm-eval's configs ask
    seed: int | None = None
    fewshot_seed: int = FEWSHOT_SEED
    output_dir: Path | None = None
    resume: bool = False

    def params(self, setting: Setting) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens or self.task.max_gen_toks,
            temperature=self.temperature,
            seed=self.seed,
            stop=self.task.stop,
            max_loops=setting.max_loops,
            exit_threshold=setting.exit_threshold,
        )

    def manifest(self, evaluated: str) -> dict[str, Any]:
        """What a resumed run must share with the run it continues."""
        return {
            "task": self.task.name,
            "num_fewshot": self.num_fewshot,
            "fewshot_seed": self.fewshot_seed,
            "chat": self.chat,
            "max_tokens": self.max_tokens or self.task.max_gen_toks,
            "temperature": self.temperature,
            "seed": self.seed,
            "model": evaluated,
            "scoring": LM_EVAL_VERSION,
        }

    def path(self, setting: Setting) -> Path | None:
        if self.output_dir is None:
            return None
        return self.output_dir / f"{self.task.name}-{setting.slug}.jsonl"


class Observer(Protocol):
    def started(self, index: int) -> None: ...

    def updated(self, index: int) -> None: ...

    def finished(self, index: int) -> None: ...


class _Silent:
    def started(self, index: int) -> None:
        pass

    def updated(self, index: int) -> None:
        pass

    def finished(self, index: int) -> None:
        pass


def build_prompts(
    config: EvalConfig, docs: Sequence[Doc], train: Sequence[Doc] | None
) -> tuple[list[Doc], list[str]]:
    """The evaluated documents (the first `limit`) and their prompts. Prompts are built from
    document 0 on, as lm-eval does, so the seeded few-shot draws match its."""
    chosen = list(docs[: config.limit] if config.limit is not None else docs)
    return chosen, config.task.prompts(chosen, config.num_fewshot, train, config.fewshot_seed)


def new_results(config: EvalConfig, total: int) -> list[SettingResult]:
    return [SettingResult(s, total, config.task.filter_names) for s in config.settings]


def make_record(
    config: EvalConfig, index: int, doc: Doc, prompt: str, completion: Completion
) -> dict[str, Any]:
    answer_text = after_reasoning(completion.text) if config.chat else completion.text
    scores = config.task.score(answer_text, doc)
    return {
        "index": index,
        "question": doc.question,
        "reference": config.task.reference(doc),
        "prompt": prompt,
        "output": completion.text,
        "answers": {name: answer for name, (answer, _) in scores.items()},
        "correct": {name: ok for name, (_, ok) in scores.items()},
        "num_tokens": completion.num_tokens,
        "exit_depths": completion.exit_depths,
        "finish_reason": completion.finish_reason,
    }


def run_sweep(
    config: EvalConfig,
    docs: Sequence[Doc],
    prompts: Sequence[str],
    backend: Backend,
    results: list[SettingResult],
    observer: Observer | None = None,
) -> list[SettingResult]:
    """Run every setting; `results` (from `new_results`) fill in as answers arrive."""
    observer = observer or _Silent()
    if config.output_dir is not None:
        files = [p for p in map(config.path, config.settings) if p is not None]
        manifest = config.manifest(backend.description)
        check_output_dir(config.output_dir, manifest, files, config.resume)
    for k in range(len(config.settings)):
        observer.started(k)
        _run_setting(config, k, docs, prompts, backend, results[k], observer)
        observer.finished(k)
    return results


def _run_setting(
    config: EvalConfig,
    k: int,
    docs: Sequence[Doc],
    prompts: Sequence[str],
    backend: Backend,
    result: SettingResult,
    observer: Observer,
) -> None:
    setting = config.settings[k]
    path = config.path(setting)
    done = read_records(path, list(prompts)) if path is not None and config.resume else {}
    for index in sorted(done):
        result.add(done[index], resumed=True)
    todo = [i for i in range(len(prompts)) if i not in done]
    writer = RecordWriter(path) if path is not None else None

    def on_done(position: int, completion: Completion) -> None:
        index = todo[position]
        record = make_record(config, index, docs[index], prompts[index], completion)
        if writer is not None:
            writer.write(record)
        result.add(record)
        observer.updated(k)

    result.start()
    try:
        backend.run([prompts[i] for i in todo], config.params(setting), on_done)
    finally:
        result.finish()
        if writer is not None:
            writer.close()
