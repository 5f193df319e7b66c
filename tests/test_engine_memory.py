"""The engine's KV memory plan: explicit sizes win, CPU gets a small default, and the CUDA
profiling step (the largest step the scheduler can plan) runs through the real runner."""

from __future__ import annotations

import pytest

import rlt_engine.engine as engine_module
from rlt_engine import LLM
from rlt_engine.worker.memory_plan import CPU_DEFAULT_KV_BYTES


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


def test_profile_step_runs_the_largest_batch(tiny_ouro_dir, monkeypatch):
    llm = LLM(str(tiny_ouro_dir), dtype="float32", max_num_batched_tokens=96, num_blocks=64)
    seen = {}

    def fake_profile(device, *, gpu_memory_utilization, run_max_step, reserve_bytes):
        run_max_step()  # must run on any device without touching the real pool
        seen["utilization"] = gpu_memory_utilization
        return 123 * 2**20

    monkeypatch.setattr(engine_module, "profile_kv_budget", fake_profile)
    assert llm.engine._profile_kv_budget() == 123 * 2**20
    assert seen["utilization"] == 0.9
    assert llm.engine.blocks.num_used == 0
