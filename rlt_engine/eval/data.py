"""GSM8K documents: from a JSONL file (`--data`), or from the Hugging Face `datasets` library
(`openai/gsm8k`, config `main`), which keeps its own local cache.

`datasets` is optional (not a dependency of rlt): without it, or offline with nothing cached,
loading fails with one line that says to pass `--data FILE.jsonl`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HUB_DATASET = ("openai/gsm8k", "main")  # the dataset_path / dataset_name lm-eval 0.4.x uses


class DataError(ValueError):
    """A data set that cannot be read or loaded (one line for the user)."""


@dataclass(frozen=True)
class Doc:
    """One GSM8K problem: the question and its worked answer, which ends with `#### N`."""

    question: str
    answer: str


def load_docs(split: str, path: Path | None, flag: str = "--data") -> list[Doc]:
    """The `split` of GSM8K: from `path` (JSONL of {"question", "answer"}) when given, else
    through `datasets` (its cache, or the Hub)."""
    if path is not None:
        return read_jsonl(path, flag)
    return load_hub(split, flag)


def read_jsonl(path: Path, flag: str = "--data") -> list[Doc]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{flag} {path}: cannot read it ({' '.join(str(exc).split())})") from None
    docs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{flag} {path} line {number}: not valid JSON ({exc.msg})") from None
        docs.append(_doc(record, f"{flag} {path} line {number}"))
    if not docs:
        raise DataError(f"{flag} {path} holds no problem")
    return docs


def load_hub(split: str, flag: str = "--data") -> list[Doc]:
    name, config = HUB_DATASET
    hint = f'pass {flag} FILE.jsonl (one {{"question": ..., "answer": ...}} object per line)'
    try:
        import datasets  # optional: large, and only needed without --data
    except ImportError:
        raise DataError(
            f"loading {name} needs the `datasets` package (pip install datasets); or {hint}"
        ) from None
    try:
        with _quiet("datasets", "huggingface_hub", "fsspec"):  # no retry warnings: one line
            rows = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # offline, not cached, hub errors: all the same advice
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        raise DataError(
            f"cannot load {name} ({config}, {split}) from the datasets cache or the Hugging "
            f"Face Hub ({reason}); offline, {hint}"
        ) from None
    return [_doc(row, f"{name} {split} row {i}") for i, row in enumerate(rows)]


@contextmanager
def _quiet(*names: str) -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _doc(record: object, where: str) -> Doc:
    if not isinstance(record, dict):
        raise DataError(f'{where}: expected an object with "question" and "answer"')
    values = [record.get(key) for key in ("question", "answer")]
    if not all(isinstance(v, str) for v in values):
        raise DataError(f'{where}: needs "question" and "answer" strings')
    return Doc(question=values[0], answer=values[1])  # type: ignore[arg-type]
