"""A failing step aborts exactly the requests it touched, frees their KV, and leaves the
engine usable; an interrupted `generate` frees everything it had started."""

from __future__ import annotations

import pytest

from rlt_engine import LLM, SamplingParams
from rlt_engine.engine import StepFailedError


@pytest.fixture
def llm(tiny_ouro_dir):
    return LLM(str(tiny_ouro_dir), dtype="float32", max_num_seqs=2, num_blocks=400)


def test_failed_step_aborts_only_touched_requests(llm, monkeypatch):
    engine = llm.engine
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = engine.add_request([5, 6, 7], params)
    second = engine.add_request([8, 9], params)
    waiting = engine.add_request([1, 2, 3, 4], params)  # no slot yet: untouched
    real = engine.runner.launch

    def boom(plan):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(engine.runner, "launch", boom)
    with pytest.raises(StepFailedError, match="device fell over") as info:
        engine.step()
    assert first in str(info.value) and second in str(info.value)
    assert waiting not in str(info.value)
    monkeypatch.setattr(engine.runner, "launch", real)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == [waiting]
    assert len(outs[0].token_ids) == 6
    assert engine.blocks.num_used == 0 and not engine.runner.active_slots()


def test_async_failure_while_collecting_aborts_both_plans_in_flight(tiny_ouro_dir, monkeypatch):
    llm = LLM(str(tiny_ouro_dir), dtype="float32", max_num_seqs=2, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ids = [engine.add_request([5, 6, 7], params), engine.add_request([8, 9], params)]
    engine.step()
    engine.step()
    assert engine.scheduler.plans_in_flight == 1
    real = engine.runner.collect

    def boom(launched):
        raise RuntimeError("lost the device")

    monkeypatch.setattr(engine.runner, "collect", boom)
    with pytest.raises(StepFailedError, match="lost the device") as info:
        engine.step()
    assert all(rid in str(info.value) for rid in ids)
    assert info.value.request_ids == tuple(ids)
    monkeypatch.setattr(engine.runner, "collect", real)
    assert engine.scheduler.plans_in_flight == 0 and not engine.has_unfinished_requests()
    assert engine.blocks.num_used == 0
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4 and not engine.runner.active_slots()


def test_interrupted_generate_frees_everything(llm, monkeypatch):
    calls = {"n": 0}
    real_step = llm.engine.step

    def step_then_interrupt():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7], [8, 9], [1, 2]], SamplingParams(max_tokens=5, ignore_eos=True))
    monkeypatch.setattr(llm.engine, "step", real_step)
    assert not llm.engine.has_unfinished_requests()
    llm.generate([[3, 4]], SamplingParams(max_tokens=2))  # flushes the freed slots
    assert llm.engine.blocks.num_used == 0
