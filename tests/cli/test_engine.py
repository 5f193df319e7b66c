"""The CLI's in-process engine (rlt_cli/engine.py)."""

from __future__ import annotations

import gc

from rlt_cli.engine import load_llm
from rlt_engine.heap import YOUNG_THRESHOLD


def test_load_llm_freezes_the_startup_heap() -> None:
    """`rlt generate | bench | profile | eval` keep one engine until they exit: what loading
    made is frozen, and young collections are spaced (the conftest undoes both)."""
    llm = load_llm({"model": "demo", "device": "cpu", "dtype": "float32"})
    assert llm.info.model_type == "ouro"
    assert gc.get_freeze_count() > 10_000
    assert gc.get_threshold()[0] == YOUNG_THRESHOLD
