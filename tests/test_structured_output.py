"""Structured output end to end on the bundled demo model (real tokenizer, CPU, fp32): every
constrained request equals the dense oracle driven by its own xgrammar matcher, token for
token, beside free rows, with slots reused, no-refill cohorts, asynchronous scheduling and a
preemption into a reused slot; the texts follow their grammars."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from engine_helpers import ENGINES, check_no_blocks_in_use, oracle_greedy, until_stop

from rlt_engine import LLM, SamplingParams
from rlt_engine.core.plan import StepPlan
from rlt_engine.models.tokenizer import render_chat
from rlt_engine.sampling_params import StructuredOutput
from rlt_engine.structured import GrammarError, Grammars

QUESTION = "Tom has 3 apples and buys 5 more. How many apples does he have?"
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "maximum": 100}, "unit": {"enum": ["a", "b"]}},
    "required": ["answer", "unit"],
}
SPECS = [
    StructuredOutput(choice=("yes", "no", "maybe so")),
    None,  # free rows share the constrained windows unchanged
    StructuredOutput(regex=r"[0-9]{1,3} apples"),
    StructuredOutput(json=SCHEMA),
    StructuredOutput(regex=r"[a-z ]+"),  # bites often: no digits, capitals or punctuation
    None,
]


@pytest.fixture(autouse=True)
def _no_blocks_in_use_after_each_test():  # type: ignore[no-untyped-def]
    yield
    check_no_blocks_in_use()


def _demo(**options) -> LLM:  # type: ignore[no-untyped-def]
    llm = LLM("demo", dtype="float32", device="cpu", **options)
    ENGINES.append(llm)
    return llm


def _prompts(llm: LLM) -> list[list[int]]:
    questions = [QUESTION, "What is 2 + 2?", "Name a fruit.", QUESTION, "Say hello.", "12 - 5?"]
    tokenizer = llm.engine.tokenizer
    return [render_chat(tokenizer, [{"role": "user", "content": q}]) for q in questions]


def _check(llm: LLM, outs, prompts, params) -> None:  # type: ignore[no-untyped-def]
    stops = {id(p): llm.engine._stop_ids(p) for p in params}
    for out, prompt, p in zip(outs, prompts, params, strict=True):
        want = until_stop(*oracle_greedy(llm, prompt, p), stops[id(p)])
        assert (out.token_ids, out.exit_depths, out.finish_reason) == want, out.request_id


@pytest.mark.parametrize(
    "options",
    [
        dict(max_num_seqs=2, block_size=4),  # a queue: slots reused by later requests
        dict(refill=False, max_num_seqs=6, block_size=2),  # cohorts: held rows sit out
        dict(async_scheduling=True, decode_window=5, block_size=4),  # masks one window late
    ],
    ids=["slots-reused", "no-refill", "async"],
)
def test_constrained_greedy_equals_the_oracle_and_follows_its_grammar(options):
    llm = _demo(**options)
    prompts = _prompts(llm)
    params = [SamplingParams(max_tokens=30, structured=s) for s in SPECS]
    outs = llm.generate(prompts, params)
    _check(llm, outs, prompts, params)
    texts = [o.text for o in outs]
    assert texts[0] in SPECS[0].choice and outs[0].finish_reason == "stop"
    assert re.fullmatch(SPECS[2].regex, texts[2]) and outs[2].finish_reason == "stop"
    answer = json.loads(texts[3])
    assert set(answer) == {"answer", "unit"} and answer["answer"] <= 100
    assert re.fullmatch(SPECS[4].regex, texts[4])
    free = llm.generate(prompts, SamplingParams(max_tokens=30))
    assert sum(a.token_ids != b.token_ids for a, b in zip(outs, free, strict=True)) >= 4


def test_preempted_while_held_and_resumed_into_a_reused_slot_is_exact():
    """Asynchronous scheduling, two constrained requests in both slots, an urgent one that
    preempts one of them (its row held for a mask or mid-token, a window in flight) and takes
    its slot; the victim resumes in whichever slot frees. = synchronous = the oracle."""

    def run(asynchronous: bool) -> tuple[dict, list[StepPlan]]:
        llm = _demo(
            async_scheduling=asynchronous, max_num_seqs=2, scheduling_policy="priority",
            enable_preemption=True, incremental_kv=True, block_size=2, decode_window=5,
        )  # fmt: skip
        engine, prompts = llm.engine, _prompts(llm)
        engine.scheduler.trace = []
        spec = StructuredOutput(regex=r"[a-z ]+")
        long = SamplingParams(max_tokens=16, priority=5, structured=spec)
        engine.add_request(prompts[0], long, request_id="a")
        engine.add_request(prompts[4], long, request_id="b")
        finals: dict = {}
        for step in range(400):
            if step == 3:
                urgent = SamplingParams(max_tokens=4, structured=SPECS[0])
                engine.add_request(prompts[1], urgent, request_id="u")
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
            if step > 3 and not engine.has_unfinished_requests():
                break
        assert engine.runner.snapshots == {} and engine.runner.active_slots() == []
        ran = {"a": (prompts[0], long), "b": (prompts[4], long), "u": (prompts[1], urgent)}
        for rid, (prompt, p) in ran.items():
            want = until_stop(*oracle_greedy(llm, prompt, p), engine._stop_ids(p))
            got = finals[rid]
            assert (got.token_ids, got.exit_depths, got.finish_reason) == want, rid
        return finals, engine.scheduler.trace

    got, trace = run(asynchronous=True)
    assert _slot_reused_while_preempted(trace), "the scenario did not happen"
    want, _ = run(asynchronous=False)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in want.items()}


def _slot_reused_while_preempted(trace: list[StepPlan]) -> bool:
    for i, plan in enumerate(trace):
        for out in plan.swap_outs:
            later = trace[i:]
            reused = any(init.slot == out.slot for p in later for init in p.slot_inits)
            resumed = any(s.snapshot == out.snapshot for p in later for s in p.swap_ins)
            if reused and resumed:
                return True
    return False


def test_a_constrained_row_emits_one_token_a_window_and_waits_for_its_mask():
    """Each token of a constrained request comes back in a window of its own, and each mask
    after the first travels in a plan's MaskUpdate; a free request beside it decodes several
    tokens a window."""
    llm = _demo(decode_window=8, block_size=4)
    engine, prompts = llm.engine, _prompts(llm)
    engine.scheduler.trace = []
    constrained = SamplingParams(max_tokens=12, structured=StructuredOutput(regex=r"[a-z ]+"))
    engine.add_request(prompts[4], constrained, request_id="c")
    engine.add_request(prompts[2], SamplingParams(max_tokens=12, ignore_eos=True), request_id="f")
    requests = {rid: engine._requests[rid].req for rid in ("c", "f")}
    have, most = {"c": 0, "f": 0}, {"c": 0, "f": 0}
    while engine.has_unfinished_requests():
        engine.step()
        for rid, req in requests.items():
            most[rid] = max(most[rid], len(req.output_token_ids) - have[rid])
            have[rid] = len(req.output_token_ids)
    assert most["c"] == 1 and most["f"] > 1
    assert sum(len(p.mask_updates) for p in engine.scheduler.trace) == have["c"] - 1


def test_async_with_only_constrained_rows_plans_no_window_they_would_sit_out():
    """Asynchronous, with every running row constrained, the next plan waits for the tokens
    in flight (their masks): each window after the first tokens carries every row's mask,
    none runs with all rows held; the tokens equal the synchronous engine's."""
    outs = {}
    for asynchronous in (True, False):
        llm = _demo(async_scheduling=asynchronous, decode_window=8, block_size=4)
        engine, prompts = llm.engine, _prompts(llm)
        engine.scheduler.trace = []
        spec = StructuredOutput(regex=r"[a-z ]+")
        params = SamplingParams(max_tokens=10, ignore_eos=False, structured=spec)
        outs[asynchronous] = llm.generate([prompts[4], prompts[2]], params)
        decode = [p for p in engine.scheduler.trace if p.decode_traversals and not p.prefill]
        assert decode and all(p.mask_updates for p in decode)
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]


# -- the host side: compiling and masks ------------------------------------------------------


def allowed_tokens(mask: bytes, vocab_size: int) -> list[int]:
    """The token ids a mask allows: bit t % 32 of little-endian int32 word t // 32."""
    words = np.frombuffer(mask, dtype="<i4").astype(np.uint32)
    bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return [int(t) for t in np.flatnonzero(bits.reshape(-1)[:vocab_size])]


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from rlt_engine.checkpoints.aliases import DEMO_DIR
    from rlt_engine.models.tokenizer import load_tokenizer

    return load_tokenizer(DEMO_DIR)


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:  # type: ignore[no-untyped-def]
    return Grammars(tokenizer, 4096)


def test_a_choice_allows_the_first_tokens_of_its_strings(grammars, tokenizer):
    matcher = grammars.matcher(StructuredOutput(choice=('say "hi"', "no")), [0])
    firsts = {tokenizer.decode([t]) for t in allowed_tokens(matcher.mask(), grammars.vocab_size)}
    assert firsts and all('say "hi"'.startswith(f) or "no".startswith(f) for f in firsts)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput(regex="(("), "the regex does not compile: Regex parsing error"),
        (StructuredOutput(json={"type": "nonsense"}), "the json does not compile: Unsupported"),
        (StructuredOutput(grammar="root ::= foo"), "the grammar does not compile: EBNF parser"),
    ],
)
def test_a_grammar_that_does_not_compile_is_a_clear_error(grammars, spec, message):
    with pytest.raises(GrammarError, match=re.escape(message)):
        grammars.matcher(spec, [0])


def test_structured_output_needs_a_stop_token_and_one_kind():
    with pytest.raises(ValueError, match="needs a stop token"):
        _demo().generate(["x"], SamplingParams(ignore_eos=True, structured={"regex": "a+"}))
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex"):
        StructuredOutput(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput()
    with pytest.raises(ValueError, match="non-empty strings"):
        StructuredOutput(choice=["a", ""])
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured={"regex": "a+"})
