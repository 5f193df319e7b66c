"""The in-process engine of `rlt generate`, `bench`, `profile` and `eval`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlt_cli.output import status_spinner

if TYPE_CHECKING:
    from rlt_engine.llm import LLM


def load_llm(options: dict[str, Any]) -> LLM:
    """`LLM(**options)` under a spinner. A command keeps its engine until it exits, so the
    startup heap is frozen (rlt_engine/heap.py): no full collection walks the model and torch
    between two steps."""
    from rlt_engine.heap import freeze_startup_heap
    from rlt_engine.llm import LLM

    with status_spinner("loading model"):
        llm = LLM(**options)
    freeze_startup_heap()
    return llm
