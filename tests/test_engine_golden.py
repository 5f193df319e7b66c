"""The engine's greedy outputs against the official Ouro code, at every depth, in every
scheduling and memory mode.

`greedy_by_depth[d]` was produced by the official code with `total_ut_steps = d`, so each depth
runs on a copy of the checkpoint configured that way (every token runs exactly d loops). Every
fast path (attention backends, CUDA graphs, decode windows, async scheduling, speculation,
HTTP) joins `MODES`.
"""

from __future__ import annotations

from typing import Any

import golden
import pytest

from rlt_engine import LLM, SamplingParams

BLOCK = 4
LONGEST = max(len(p) for p in golden.prompts()) + golden.new_tokens() - 1  # KV positions


def _one_request_pool(depth: int, block_size: int = BLOCK) -> int:
    """Blocks for the longest request alone (all planes): two can never run at once."""
    return depth * -(-LONGEST // block_size)


# name -> engine options (callables get the depth). Each mode must reproduce the official code.
MODES: dict[str, dict[str, Any]] = {
    "refill": {},
    "no-refill": {"refill": False},
    "block-1": {"block_size": 1},
    "block-16": {"block_size": 16},
    "chunk-3": {"prefill_chunk_size": 3, "max_num_batched_tokens": 8, "max_num_seqs": 4},
    "chunk-5-budget-7": {"prefill_chunk_size": 5, "max_num_batched_tokens": 7, "max_num_seqs": 7},
    # A window reserves KV for its traversals ahead, so short windows are what make these
    # tight pools preempt mid-decode (asserted below).
    "one-request-pool-incremental-preempt": {
        "incremental_kv": True,
        "enable_preemption": True,
        "num_blocks": _one_request_pool,
        "decode_window": 2,
    },
    "one-request-pool-reserved": {"num_blocks": _one_request_pool},
    "prefix-caching": {"enable_prefix_caching": True},
    "priority-preempt": {
        "scheduling_policy": "priority",
        "enable_preemption": True,
        "incremental_kv": True,
        "num_blocks": lambda d: 2 * _one_request_pool(d),
        "decode_window": 1,
    },
    "triton-interpreted": {"attention_backend": "triton"},
    "decode-window-1": {"decode_window": 1},
    "decode-window-5": {"decode_window": 5},
    # asynchronous scheduling: the host plans a window ahead of what it has seen
    "async": {"async_scheduling": True},
    "async-no-refill": {"async_scheduling": True, "refill": False},
    "async-chunk-3": {
        "async_scheduling": True,
        "prefill_chunk_size": 3,
        "max_num_batched_tokens": 8,
        "max_num_seqs": 4,
    },
    "async-one-request-pool-incremental-preempt": {
        "async_scheduling": True,
        "incremental_kv": True,
        "enable_preemption": True,
        "num_blocks": _one_request_pool,
        "decode_window": 2,
    },
    "async-prefix-caching": {"async_scheduling": True, "enable_prefix_caching": True},
    "async-priority-preempt": {
        "async_scheduling": True,
        "scheduling_policy": "priority",
        "enable_preemption": True,
        "incremental_kv": True,
        "num_blocks": lambda d: 2 * _one_request_pool(d),
        "decode_window": 1,
    },
}


def _llm(depth: int, tmp_path_factory: pytest.TempPathFactory, mode: str) -> LLM:
    root = tmp_path_factory.getbasetemp() / "golden"
    options = {"block_size": BLOCK, "num_blocks": 256}
    for key, value in MODES[mode].items():
        options[key] = value(depth) if callable(value) else value
    return LLM(str(golden.golden_dir(root, depth)), dtype="float32", device="cpu", **options)


def _params(priority: int = 0, max_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens or golden.new_tokens(), ignore_eos=True, priority=priority
    )


# The interpreted Triton kernel is slow on the CPU: it runs at full depth only (CUDA: all),
# and the first half of each official continuation.
INTERPRETED = {"triton-interpreted"}
CASES = [
    (depth, mode)
    for depth in range(1, golden.DEPTH + 1)
    for mode in MODES
    if mode not in INTERPRETED or depth == golden.DEPTH
]


@pytest.mark.parametrize(("depth", "mode"), CASES)
def test_engine_greedy_equals_official_code(tmp_path_factory, depth: int, mode: str):
    llm = _llm(depth, tmp_path_factory, mode)
    prompts = golden.prompts()
    n = golden.new_tokens() // 2 if mode in INTERPRETED else golden.new_tokens()
    # Priorities invert arrival order so that later arrivals preempt earlier ones.
    params = [_params(len(prompts) - i, n) for i in range(len(prompts))]
    rounds = 2 if mode.endswith("prefix-caching") else 1  # the second round hits the cache
    for _ in range(rounds):
        outs = llm.generate(prompts, params)
        for out, want in zip(outs, golden.greedy(depth), strict=True):
            want = want[:n]
            assert out.token_ids == want, (mode, out.prompt_token_ids)
            assert out.exit_depths == [depth] * len(want)
            assert out.finish_reason == "length"
    stats = llm.engine.cache_stats()
    assert stats["blocks_used"] == 0
    if mode.endswith("prefix-caching"):
        assert stats["prefix_hit_blocks"] > 0
    if "one-request-pool-incremental" in mode or mode.endswith("priority-preempt"):
        assert stats["preemptions"] > 0
    assert llm.engine.async_scheduling == mode.startswith("async")


def test_shared_layout_at_depth_one_equals_official_code(tmp_path_factory):
    """With one loop the SHARED plane is the only plane: the layout is exact there."""
    root = tmp_path_factory.getbasetemp() / "golden"
    llm = LLM(str(golden.golden_dir(root, 1)), dtype="float32", device="cpu", kv_layout="shared")
    outs = llm.generate(golden.prompts(), _params())
    assert [o.token_ids for o in outs] == golden.greedy(1)


def test_max_loops_below_the_depth_runs_shallow_decode_over_a_full_depth_prompt(tmp_path_factory):
    """max_loops=d on the 4-loop model is NOT the official depth-d model (prompts run 4 loops):
    its first token is the full-depth one, later tokens differ. A guard that the depth-d
    copies above really test the depth they claim."""
    root = tmp_path_factory.getbasetemp() / "golden"
    llm = LLM(str(golden.golden_dir(root, golden.DEPTH)), dtype="float32", device="cpu")
    outs = llm.generate(
        golden.prompts(), SamplingParams(max_tokens=4, max_loops=1, ignore_eos=True)
    )
    for out, full, shallow in zip(outs, golden.greedy(4), golden.greedy(1), strict=True):
        assert out.token_ids[0] == full[0]
        assert out.exit_depths == [4, 1, 1, 1]
        assert out.token_ids != shallow[:4]
