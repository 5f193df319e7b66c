"""The engine's KV memory plan: explicit sizes win, CPU gets a small default, and the CUDA
profiling step (the largest step the scheduler can plan) runs through the real runner."""

from __future__ import annotations

import pytest
import torch

import rlt_engine.engine as engine_module
from rlt_engine import LLM, SamplingParams
from rlt_engine.worker.memory_plan import CPU_DEFAULT_KV_BYTES, DEFAULT_CUDA_RESERVE_BYTES


def test_plan_sources_and_layout_memory(tiny_ouro_dir):
    llm = LLM(str(tiny_ouro_dir), dtype="float32", num_blocks=64)
    plan = llm.engine.memory_plan
    assert (plan.source, plan.num_blocks, plan.num_planes) == ("num_blocks", 64, 4)
    shared = LLM(str(tiny_ouro_dir), dtype="float32", kv_layout="shared", kv_cache_memory=2**20)
    assert shared.engine.memory_plan.source == "kv_cache_memory"
    assert shared.engine.memory_plan.num_planes == 1
    assert shared.engine.blocks.blocks_needed(100) * 4 == llm.engine.blocks.blocks_needed(100)
    default = LLM(str(tiny_ouro_dir), dtype="float32")
    assert default.engine.memory_plan.source == "cpu_default"
    assert default.engine.memory_plan.kv_bytes_total <= CPU_DEFAULT_KV_BYTES


def test_num_blocks_and_kv_cache_memory_together_are_refused(tiny_ouro_dir):
    with pytest.raises(ValueError, match="at most one"):
        LLM(str(tiny_ouro_dir), num_blocks=8, kv_cache_memory=2**20)


def _record_model_calls(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Wrap the model's traversal and read-out to record the shapes every step really ran."""
    model, seen = llm.engine.model, {"recurrent": [], "coda": []}
    recurrent, coda = model.recurrent, model.coda

    def recording_recurrent(hidden, meta, backend, **options):
        seen["recurrent"].append((tuple(hidden.shape), meta.positions.tolist()))
        return recurrent(hidden, meta, backend, **options)

    def recording_coda(hidden, **options):
        seen["coda"].append(tuple(hidden.shape))
        return coda(hidden, **options)

    monkeypatch.setattr(model, "recurrent", recording_recurrent)
    monkeypatch.setattr(model, "coda", recording_coda)
    return seen


def test_profile_step_is_the_largest_step_the_scheduler_plans(tiny_ouro_dir, monkeypatch):
    budget, max_seqs, hidden = 96, 6, 64
    llm = LLM(
        str(tiny_ouro_dir),
        dtype="float32",
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        gpu_memory_utilization=0.7,
        num_blocks=512,
        block_size=4,
    )
    seen = _record_model_calls(llm, monkeypatch)
    # A real workload that fills the token budget (long prompts, chunked prefill) and then
    # decodes more requests than may run at once, with adaptive exits (CODA steps).
    prompts = [[(11 * i + 7 * j) % 900 + 3 for j in range(40 + 9 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=5, ignore_eos=True, exit_threshold=0.5)
    llm.generate(prompts, params)
    real_rows = max(shape[0] for shape, _ in seen["recurrent"])
    real_coda = max(shape[0] for shape in seen["coda"])
    assert real_rows == budget  # the workload reaches the budget, and never exceeds it
    assert real_coda <= max_seqs
    pool = (llm.engine.runner.kv.k.clone(), llm.engine.runner.kv.v.clone())
    seen["recurrent"].clear()
    seen["coda"].clear()
    calls = []

    def fake_profile(device, *, gpu_memory_utilization, run_max_step, reserve_bytes):
        calls.append((gpu_memory_utilization, reserve_bytes))
        run_max_step()  # must run on any device without touching the real pool
        return 0

    monkeypatch.setattr(engine_module, "profile_kv_budget", fake_profile)
    llm.engine._profile_kv_budget()
    assert calls == [(0.7, DEFAULT_CUDA_RESERVE_BYTES)]
    # What was profiled: a traversal of the whole token budget as one prefill chunk (positions
    # 0..budget-1), the most rows any real step ran, and lm_head over a row for every request
    # that may be running, at least as many as any real read-out.
    profiled_rows = [shape for shape, _ in seen["recurrent"]]
    assert max(rows for rows, _ in profiled_rows) == budget >= real_rows
    assert all(width == hidden for _, width in profiled_rows)
    assert ((budget, hidden), list(range(budget))) in seen["recurrent"]
    assert max(seen["coda"]) == (max_seqs, hidden) and max_seqs >= real_coda
    assert torch.equal(llm.engine.runner.kv.k, pool[0])  # the real pool is left alone
    assert torch.equal(llm.engine.runner.kv.v, pool[1])


def test_profile_step_stays_within_the_model_context(tiny_ouro_dir, monkeypatch):
    """A token budget at or past the context (the default 2048 against a 2048-position model)
    profiles a prompt of context - 1 tokens: the decode step after it writes one more."""
    llm = LLM(str(tiny_ouro_dir), dtype="float32", num_blocks=64, block_size=16)
    context = llm.engine.model_config.max_position_embeddings
    assert llm.engine.config.scheduler.max_num_batched_tokens >= context
    seen = _record_model_calls(llm, monkeypatch)

    def fake_profile(device, *, gpu_memory_utilization, run_max_step, reserve_bytes):
        run_max_step()
        return 0

    monkeypatch.setattr(engine_module, "profile_kv_budget", fake_profile)
    llm.engine._profile_kv_budget()
    assert max(shape[0] for shape, _ in seen["recurrent"]) == context - 1
