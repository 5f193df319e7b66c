"""Shared by the tiny-engine tests (test_engine_equivalence.py, test_engine_lifecycle.py).

Token-id prompts with a mix of loop controls, a cached serial (single-request, contiguous-cache)
greedy decode to compare batched output against, and `ENGINES`, the engines each test module's
autouse fixture checks for leaked KV blocks after every test. `ckpt` is a conftest fixture;
`llm` and friends live in each test module.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rlt_engine import LLM, SamplingParams
from rlt_engine.core.exit_rule import LoopControls
from rlt_engine.models.contiguous_kv import greedy_decode

DEPTH = 4  # the tiny Ouro's total_ut_steps

ENGINES: list[LLM] = []  # every LLM a test made or used: checked for leaks after each test


def check_no_blocks_in_use() -> None:
    """Every engine a test made or used holds no KV block and no request; then forget them."""
    for llm in ENGINES:
        assert llm.engine.blocks.num_used == 0, "KV blocks leaked"
        assert not llm.engine.has_unfinished_requests()
    ENGINES.clear()


def make_llm(path: Path, **options: Any) -> LLM:
    llm = LLM(str(path), dtype="float32", device="cpu", **{"num_blocks": 512, **options})
    ENGINES.append(llm)
    return llm


_rng = random.Random(1234)
PROMPTS = [[_rng.randrange(3, 49152) for _ in range(n)] for n in (1, 2, 3, 5, 8, 13, 17, 21, 4)]
# (min_loops, max_loops, exit_threshold, max_tokens) per prompt: a mix of fixed depth, adaptive
# exits at several thresholds, min_loops holding exits back and max_loops below the depth
CONTROLS = [
    (1, 4, 1.0, 6),
    (1, 4, 0.3, 3),
    (1, 4, 0.5, 7),
    (2, 4, 0.4, 5),
    (1, 3, 0.6, 6),
    (1, 4, 0.7, 4),
    (1, 2, 1.0, 7),
    (1, 4, 0.2, 5),
    (3, 4, 0.5, 6),
]


def params_for(i: int, **extra: Any) -> SamplingParams:
    lo, hi, th, n = CONTROLS[i]
    return SamplingParams(
        max_tokens=n, min_loops=lo, max_loops=hi, exit_threshold=th, ignore_eos=True, **extra
    )


_SERIAL: dict[tuple, tuple[list[int], list[int]]] = {}


def serial(llm: LLM, prompt: list[int], p: SamplingParams) -> tuple[list[int], list[int]]:
    """Single-request greedy decode over a contiguous cache (no paging, no batching)."""
    key = (tuple(prompt), p.max_tokens, p.min_loops, p.max_loops, p.exit_threshold)
    if key not in _SERIAL:
        controls = LoopControls(
            p.min_loops or 1,
            p.max_loops or DEPTH,
            1.0 if p.exit_threshold is None else p.exit_threshold,
        )
        _SERIAL[key] = greedy_decode(llm.engine.model, prompt, p.max_tokens, controls)
    return _SERIAL[key]


def check_against_serial(llm: LLM, outs: list, prompts: list, params: list) -> None:
    for out, prompt, p in zip(outs, prompts, params, strict=True):
        assert out.prompt_token_ids == prompt
        assert (out.token_ids, out.exit_depths) == serial(llm, prompt, p), out.request_id
        assert out.finish_reason == "length" and out.finished
