"""Shared by the tiny-engine tests (test_engine_equivalence.py, test_engine_lifecycle.py).

Token-id prompts with a mix of loop controls, the dense fp32 oracle's greedy decode (memoised) to
compare batched output against, and `ENGINES`, the engines each test module's
autouse fixture checks for leaked KV blocks after every test. `ckpt` is a conftest fixture;
`llm` and friends live in each test module.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from rlt_engine import LLM, SamplingParams
from rlt_engine.oracle.reference import Constrain, reference_greedy
from rlt_engine.oracle.reference_shared import shared_greedy

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


_ORACLE: dict[tuple, tuple[list[int], list[int]]] = {}


def oracle_greedy(
    llm: LLM, prompt: list[int], p: SamplingParams, layout: str = "last_exited"
) -> tuple[list[int], list[int]]:
    """(token ids, exit depths) of the dense fp32 oracle: plain functions over the state dict,
    nothing shared with the modules, caches or scheduler under test. `llm` only lends its
    weights and config (memoised per checkpoint directory)."""
    model = llm.engine.model
    key = (
        str(llm.engine.model_dir),
        layout,
        tuple(prompt),
        p.max_tokens,
        p.min_loops,
        p.max_loops,
        p.exit_threshold,
        p.presence_penalty,
        p.frequency_penalty,
        p.repetition_penalty,
        p.logit_bias,
        p.min_tokens,
        p.stop_token_ids,
        p.structured,
    )
    if key not in _ORACLE:
        decode = shared_greedy if layout == "shared" else reference_greedy
        _ORACLE[key] = decode(
            model.state_dict(),
            model.config,
            prompt,
            p.max_tokens,
            min_loops=p.min_loops or 1,
            max_loops=p.max_loops or model.num_loops,
            exit_threshold=(
                model.config.early_exit_threshold if p.exit_threshold is None else p.exit_threshold
            ),
            edits=p,
            constrain=grammar_constrain(llm, p),
        )
    return _ORACLE[key]


def grammar_constrain(llm: LLM, p: SamplingParams) -> Constrain | None:
    """The oracle's side of structured output: a fresh xgrammar matcher replayed over the
    output so far, its mask applied by xgrammar's own function (not the engine's masks,
    holds and bit unpacking). The grammar is compiled as the engine compiles it."""
    if p.structured is None:
        return None
    import xgrammar as xgr

    engine = llm.engine
    compiled = engine._grammars()._compile(p.structured)
    vocab, stops = engine.model_config.vocab_size, sorted(engine._stop_ids(p))

    def constrain(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        for token in output:
            if matcher.is_terminated():  # past its stop token: until_stop cuts the rest
                return logits
            assert matcher.accept_token(token), f"the grammar refuses token {token}"
        if matcher.is_terminated():
            return logits
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(bitmask)
        masked = logits[None].clone()
        xgr.apply_token_bitmask_inplace(masked, bitmask)
        return masked[0]

    return constrain


def until_stop(tokens: list[int], depths: list[int], stops) -> tuple:  # type: ignore[no-untyped-def]
    """(tokens, depths, finish reason) of an oracle run cut after its first stop id."""
    cut = next((i + 1 for i, t in enumerate(tokens) if t in stops), None)
    if cut is None:
        return tokens, depths, "length"
    return tokens[:cut], depths[:cut], "stop"


serial = oracle_greedy  # the name the equivalence and lifecycle tests use


def check_against_serial(llm: LLM, outs: list, prompts: list, params: list) -> None:
    for out, prompt, p in zip(outs, prompts, params, strict=True):
        assert out.prompt_token_ids == prompt
        assert (out.token_ids, out.exit_depths) == oracle_greedy(llm, prompt, p), out.request_id
        assert out.finish_reason == "length" and out.finished


def queued_workload(model_dir, device: str, asynchronous: bool) -> tuple[list, int]:
    """Seven requests through two slots (a queue all along), mixed max_tokens, adaptive exits
    and seeded sampling: (token ids and exit depths of each, slots handed on early)."""
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device=device,
        async_scheduling=asynchronous,
        max_num_seqs=2,
        block_size=4,
        decode_window=5,
    )
    sched = llm.engine.scheduler
    handed = []
    real_retire = sched._retire

    def retire(ran: dict[int, int]) -> None:
        before = len(sched.retiring)
        real_retire(ran)
        handed.append(len(sched.retiring) - before)

    sched._retire = retire
    prompts = [[(11 * i + j) % 300 + 3 for j in range(3 + 2 * i)] for i in range(7)]
    params = [
        SamplingParams(
            max_tokens=(3, 9, 5, 12, 4, 7, 6)[i],
            ignore_eos=True,
            exit_threshold=(1.0, 0.6, 0.3)[i % 3],
            **({"temperature": 0.8, "seed": i} if i % 2 else {}),
        )
        for i in range(7)
    ]
    outs = llm.generate(prompts, params)
    assert llm.engine.blocks.num_used == 0 and llm.engine.runner.active_slots() == []
    assert not sched.retiring
    return [(o.token_ids, o.exit_depths) for o in outs], sum(handed)
