"""Asynchronous scheduling: the host plans window n+1 before it has seen window n's events.
Exact in every case: here the one the published looped-model engine gets wrong — a request
preempted while a window is in flight, its slot used by another request meanwhile, then
resumed — plus aborts in flight and request-id reuse. (The golden and property suites run
their modes with async scheduling too.)"""

from __future__ import annotations

import itertools

import pytest
from engine_helpers import oracle_greedy, queued_workload

from rlt_engine import LLM, SamplingParams
from rlt_engine.core.plan import StepPlan

PROMPT_A = [3, 17, 29, 4, 8, 11]
PROMPT_B = [5, 9, 2, 30, 7]
PROMPT_U = [12, 6, 1]


def _llm(ckpt, asynchronous: bool) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(
        str(ckpt),
        dtype="float32",
        device="cpu",
        async_scheduling=asynchronous,
        max_num_seqs=2,
        scheduling_policy="priority",
        enable_preemption=True,
        incremental_kv=True,
        block_size=2,
        decode_window=5,  # > the depth: every window in flight carries tokens
    )


# greedy with penalties: each request its own, so a slot's `seen` row that travels wrong shows
PENALTIES = {
    1: dict(repetition_penalty=1.3, frequency_penalty=0.4),
    2: dict(presence_penalty=0.8),
    3: dict(repetition_penalty=0.8, frequency_penalty=-0.5, logit_bias={7: 2.0, 12: -1.0}),
}
MODES = ["greedy", "seeded-sampling", "penalized"]


def _params(mode: str, n: int, priority: int, seed: int) -> SamplingParams:
    extra = {
        "greedy": {},
        "seeded-sampling": dict(temperature=0.9, top_p=0.9),
        "penalized": PENALTIES[seed],
    }[mode]
    return SamplingParams(max_tokens=n, ignore_eos=True, priority=priority, seed=seed, **extra)


def _run(llm: LLM, mode: str) -> tuple[dict, list[StepPlan]]:
    """A and B decode in both slots; U (urgent) arrives mid-decode, preempts one of them,
    takes its slot and finishes; the victim resumes."""
    engine = llm.engine
    engine.scheduler.trace = []

    def params(n: int, priority: int, seed: int) -> SamplingParams:
        return _params(mode, n, priority, seed)

    engine.add_request(PROMPT_A, params(14, 5, 1), request_id="a")
    engine.add_request(PROMPT_B, params(14, 5, 2), request_id="b")
    finals: dict = {}
    for step in range(400):
        if step == 3:
            engine.add_request(PROMPT_U, params(4, 0, 3), request_id="u")
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if step > 3 and not engine.has_unfinished_requests():
            break
    assert engine.blocks.num_used == 0 and engine.runner.snapshots == {}
    assert engine.runner.active_slots() == []
    return finals, engine.scheduler.trace


def _slot_reused_while_preempted(trace: list[StepPlan]) -> bool:
    """A swap-out of slot S, then a slot init of S for another request, then the swap-in of
    the same snapshot (into whichever slot it gets)."""
    for i, plan in enumerate(trace):
        for out in plan.swap_outs:
            later = trace[i:]
            reused = next(
                (k for k, p in enumerate(later) if any(x.slot == out.slot for x in p.slot_inits)),
                None,
            )
            resumed = next(
                (
                    k
                    for k, p in enumerate(later)
                    if any(x.snapshot == out.snapshot for x in p.swap_ins)
                ),
                None,
            )
            if reused is not None and resumed is not None and reused <= resumed:
                return True
    return False


@pytest.mark.parametrize("mode", MODES)
def test_preempted_and_resumed_into_a_reused_slot_is_exact(ckpt, mode: str) -> None:
    got, trace = _run(_llm(ckpt, asynchronous=True), mode)
    assert _slot_reused_while_preempted(trace), "the scenario did not happen"
    want, sync_trace = _run(_llm(ckpt, asynchronous=False), mode)
    assert _slot_reused_while_preempted(sync_trace)
    assert sorted(got) == ["a", "b", "u"]
    for rid in got:
        assert got[rid].token_ids == want[rid].token_ids, rid
        assert got[rid].exit_depths == want[rid].exit_depths, rid
    if mode != "seeded-sampling":
        llm = _llm(ckpt, asynchronous=False)
        cases = (("a", PROMPT_A, 14, 1), ("b", PROMPT_B, 14, 2), ("u", PROMPT_U, 4, 3))
        for rid, prompt, n, seed in cases:
            p = _params(mode, n, 0, seed)
            assert (got[rid].token_ids, got[rid].exit_depths) == oracle_greedy(llm, prompt, p)
    if mode == "penalized":  # the penalties changed what greedy decodes
        plain, _ = _run(_llm(ckpt, asynchronous=False), "greedy")
        assert any(plain[rid].token_ids != got[rid].token_ids for rid in got)


def test_abort_in_flight_and_id_reuse(ckpt) -> None:
    llm = _llm(ckpt, asynchronous=True)
    engine = llm.engine
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request(PROMPT_A, p, request_id="x")
    engine.add_request(PROMPT_B, p, request_id="y")
    engine.step()
    engine.step()
    assert engine.scheduler.plans_in_flight == 1  # a window runs while the host looks on
    aborted = engine.abort_request("x")
    assert aborted is not None and aborted.finish_reason == "abort"
    engine.add_request(PROMPT_U, p, request_id="x")  # the id is free again, and the slot
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.blocks.num_used == 0 and engine.runner.active_slots() == []
    ref = _llm(ckpt, asynchronous=False)
    assert (finals["x"].token_ids, finals["x"].exit_depths) == oracle_greedy(ref, PROMPT_U, p)
    assert (finals["y"].token_ids, finals["y"].exit_depths) == oracle_greedy(ref, PROMPT_B, p)


def test_no_traversal_runs_once_every_row_has_ended(ckpt) -> None:
    """Async: the plan made while the last tokens are in flight carries no window for rows
    that surely end in them, and the last windows are cut to what the rows may still need,
    so every traversal has a row running (the eager trace). The same tokens as the oracle."""
    llm = _llm(ckpt, asynchronous=True)
    engine = llm.engine
    engine.runner.traversal.trace = []
    prompts = [PROMPT_A, PROMPT_B]
    p = SamplingParams(max_tokens=7, ignore_eos=True)
    outs = llm.generate(prompts, p)
    trace = engine.runner.traversal.trace
    assert trace and all(any(running) for _, running, _ in trace)
    ref = _llm(ckpt, asynchronous=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert (out.token_ids, out.exit_depths) == oracle_greedy(ref, prompt, p)


def test_default_is_on_for_cuda_only(ckpt) -> None:
    llm = LLM(str(ckpt), dtype="float32", device="cpu")
    assert llm.engine.async_scheduling is False
    assert llm.engine.scheduler.lookahead == 1


def test_first_tokens_end_their_plan_but_never_two_plans_in_a_row(ckpt) -> None:
    """Async: a plan that samples first tokens carries no decode window (they are read back
    at once: time to first token), unless the plan before it already deferred one — under a
    stream of arrivals the running requests still decode every other plan. Same outputs.
    (Waves that do not ride a window: a riding wave's first tokens come back with its window,
    tests/worker/test_riding_wave.py.)"""
    llm = _llm(ckpt, asynchronous=True)
    engine = llm.engine
    engine.scheduler.ride_waves = False
    engine.scheduler.trace = []
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    finals = {}
    for i, prompt in enumerate((PROMPT_A, PROMPT_B, PROMPT_U, PROMPT_A)):
        engine.add_request(prompt, p, request_id=f"r{i}")
        for out in engine.step():  # an arrival every step
            if out.finished:
                finals[out.request_id] = out
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    trace = engine.scheduler.trace
    firsts = [any(c.last for wave in plan.prefill for c in wave) for plan in trace]
    assert not trace[0].decode_traversals and firsts[0]  # the first plan: prefill only
    assert trace[1].decode_traversals  # its window follows at once
    deferred = [f and not plan.decode_traversals for f, plan in zip(firsts, trace, strict=True)]
    assert sum(deferred) >= 2  # the arrivals did get their first tokens early
    assert not any(a and b for a, b in itertools.pairwise(deferred))
    ref = _llm(ckpt, asynchronous=False)
    for i, prompt in enumerate((PROMPT_A, PROMPT_B, PROMPT_U, PROMPT_A)):
        got = finals[f"r{i}"]
        assert (got.token_ids, got.exit_depths) == oracle_greedy(ref, prompt, p)


def test_slots_handed_on_early_give_the_synchronous_outputs(ckpt) -> None:
    """Async with a queue: rows certain to end within the window in flight give their slot
    and blocks to queued requests a window early; outputs equal synchronous scheduling's."""
    got, handed = queued_workload(ckpt, "cpu", asynchronous=True)
    want, none = queued_workload(ckpt, "cpu", asynchronous=False)
    assert handed > 0 and none == 0
    assert got == want
