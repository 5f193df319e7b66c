"""Loading GSM8K: JSONL files (`--data`), and `datasets` (openai/gsm8k, main) with one clear
line when it is missing or cannot reach the Hub (a stand-in module: the tests never go online
and do not need `datasets` installed)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from rlt_engine.eval.data import DataError, Doc, load_docs, read_jsonl

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gsm8k"


def test_fixture_rows() -> None:
    test, train = read_jsonl(FIXTURES / "test.jsonl"), read_jsonl(FIXTURES / "train.jsonl")
    assert (len(test), len(train)) == (20, 10)
    assert test[0].question.startswith("Janet’s ducks lay 16 eggs")
    assert test[0].answer.endswith("#### 18")
    assert train[0].question.startswith("Natalia sold clips")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"question": "q"}\n', 'line 1: needs "question" and "answer" strings'),
        ('{"question": "q", "answer": "#### 1"}\nnot json\n', "line 2: not valid JSON"),
        ("[1, 2]\n", 'line 1: expected an object with "question" and "answer"'),
        ("\n\n", "holds no problem"),
    ],
)
def test_bad_jsonl(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(DataError, match=needle) as info:
        read_jsonl(path)
    assert "\n" not in str(info.value) and str(info.value).startswith(f"--data {path}")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="cannot read it"):
        load_docs("test", tmp_path / "nope.jsonl")


def fake_datasets(monkeypatch: pytest.MonkeyPatch, load: Any) -> None:
    module = types.ModuleType("datasets")
    module.load_dataset = load  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", module)


def test_hub_through_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def load(*args: Any, **kwargs: Any) -> list[dict[str, str]]:
        calls.append((args, kwargs))
        return [{"question": "q", "answer": "a\n#### 1"}]

    fake_datasets(monkeypatch, load)
    assert load_docs("test", None) == [Doc("q", "a\n#### 1")]
    assert load_docs("train", None) == [Doc("q", "a\n#### 1")]
    assert calls == [
        (("openai/gsm8k", "main"), {"split": "test"}),
        (("openai/gsm8k", "main"), {"split": "train"}),
    ]


def test_offline_without_cache_is_one_line_naming_data(monkeypatch: pytest.MonkeyPatch) -> None:
    def load(*args: Any, **kwargs: Any) -> None:
        # what datasets raises offline with nothing cached
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    fake_datasets(monkeypatch, load)
    with pytest.raises(DataError) as info:
        load_docs("test", None)
    message = str(info.value)
    assert "\n" not in message and "pass --data FILE.jsonl" in message
    assert "ConnectionError" in message and "openai/gsm8k" in message


def test_without_the_datasets_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DataError, match=r"pip install datasets.*pass --fewshot-data FILE\.jsonl"):
        load_docs("train", None, "--fewshot-data")
