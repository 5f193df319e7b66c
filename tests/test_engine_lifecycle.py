"""The engine end to end on CPU in fp32 with tiny models: a request's life and its edges.

Abort frees everything at every stage; requests arriving between steps match serial runs;
text streams, stop strings, EOS and stop ids end generation correctly; bad parameters,
prompts and engine options are rejected without leaking. After every test no engine holds a
KV block.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_helpers import (
    DEPTH,
    ENGINES,
    PROMPTS,
    check_against_serial,
    check_no_blocks_in_use,
    make_llm,
    params_for,
    serial,
)

from rlt_engine import LLM, SamplingParams
from rlt_engine.core.plan import Stage
from rlt_engine.models.tokenizer import render_chat
from rlt_engine.oracle.contiguous_kv import greedy_decode


@pytest.fixture(autouse=True)
def _no_blocks_in_use_after_each_test() -> Iterator[None]:
    yield
    check_no_blocks_in_use()


@pytest.fixture(scope="module")
def base(ckpt: Path) -> LLM:
    """One default engine shared by tests that do not care about engine options."""
    return LLM(str(ckpt), dtype="float32", device="cpu", num_blocks=512)


@pytest.fixture
def llm(base: LLM) -> LLM:
    ENGINES.append(base)
    return base


@pytest.fixture(scope="module")
def text_llm(tiny_ouro_dir: Path) -> LLM:
    """The tiny Ouro with the real tokenizer, for text, stop strings and chat."""
    return LLM(str(tiny_ouro_dir), dtype="float32", device="cpu", num_blocks=512)


@pytest.fixture
def tllm(text_llm: LLM) -> LLM:
    ENGINES.append(text_llm)
    return text_llm


# -- abort ----------------------------------------------------------------------------------


def _find(llm: LLM, rid: str):
    sched = llm.engine.scheduler
    return next((r for r in (*sched.waiting, *sched.running) if r.request_id == rid), None)


def _device_loop(llm: LLM, r) -> int:
    """Loops the request's in-flight token has finished on the device."""
    return int(llm.engine.runner.slots.loop[r.slot])


STAGE_REACHED = {
    "waiting": lambda llm, r: r is not None and r.stage is Stage.WAITING,
    "prefill_between_chunks": lambda llm, r: (
        r is not None and r.stage is Stage.PREFILL and 0 < r.num_prefilled < r.prompt_len
    ),
    "decode_mid_token": lambda llm, r: (
        r is not None and r.stage is Stage.DECODE and _device_loop(llm, r) > 0
    ),
    "decode_between_tokens": lambda llm, r: (
        r is not None
        and r.stage is Stage.DECODE
        and len(r.output_token_ids) > 1
        and _device_loop(llm, r) == 0
    ),
    "finished": lambda llm, r: r is None,
}


@pytest.mark.parametrize("stage", list(STAGE_REACHED))
def test_abort_at_every_stage_frees_everything(ckpt, stage):
    # a window of 3 traversals against depth 4 ends mid-token: every stage is reachable
    llm = make_llm(
        ckpt,
        block_size=2,
        max_num_seqs=2,
        max_num_batched_tokens=8,
        prefill_chunk_size=3,
        decode_window=3,
    )
    engine = llm.engine
    neighbour = SamplingParams(max_tokens=5, ignore_eos=True, exit_threshold=0.5)
    engine.add_request(PROMPTS[3], neighbour, request_id="n")
    if stage == "waiting":  # a third request waits behind max_num_seqs
        engine.add_request(PROMPTS[2], neighbour, request_id="m")
    victim = SamplingParams(max_tokens=8, ignore_eos=True, exit_threshold=0.0, min_loops=1)
    if stage == "decode_mid_token":
        victim = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request(PROMPTS[6], victim, request_id="v")
    finals = {}
    engine.step()
    for _ in range(500):
        if STAGE_REACHED[stage](llm, _find(llm, "v")):
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    else:
        raise AssertionError(f"stage {stage} never reached")
    out = engine.abort_request("v")
    if stage == "finished":
        assert out is None and finals["v"].finish_reason == "length"
    else:
        assert out is not None and out.finished and out.finish_reason == "abort"
        assert _find(llm, "v") is None
    # the victim's blocks are back at once: only the neighbours' tables remain
    blocks = engine.blocks
    running = engine.scheduler.running
    assert blocks.owned_blocks("v") == []
    held = [t for r in running for t in blocks.owned_blocks(r.request_id)]
    assert blocks.num_used == sum(len(t) for t in held)
    assert engine.abort_request("v") is None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.blocks.num_used == 0
    for rid, prompt in (("n", PROMPTS[3]), ("m", PROMPTS[2])):
        if rid in finals:  # the neighbours are untouched by the abort
            got = finals[rid]
            assert (got.token_ids, got.exit_depths) == serial(llm, prompt, neighbour)
    assert "v" not in finals or stage == "finished"


def test_abort_everything_mid_flight(ckpt):
    llm = make_llm(ckpt, block_size=1, num_blocks=300, max_num_seqs=3, max_num_batched_tokens=5)
    engine = llm.engine
    ids = [engine.add_request(p, params_for(i)) for i, p in enumerate(PROMPTS)]
    for _ in range(7):
        engine.step()
    assert engine.blocks.num_used > 0
    for rid in ids:
        engine.abort_request(rid)
    assert engine.blocks.num_used == 0 and not engine.has_unfinished_requests()
    assert engine.step() == []
    # the engine is still usable afterwards, and exact
    outs = llm.generate(PROMPTS[:3], [params_for(i) for i in range(3)])
    check_against_serial(llm, outs, PROMPTS[:3], [params_for(i) for i in range(3)])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_final_outputs_go_out_before_the_idle_bookkeeping(ckpt, monkeypatch, async_scheduling):
    """The step that finishes the last requests returns their outputs without first sending
    the worker their slots' frees (on an H100 ~1 ms of uploads and copies, on the path of
    the last token and inside rlt bench's decode clock): `has_unfinished_requests` (or the
    next step, or LLM.generate's end) sends them, and then nothing is left on the device."""
    llm = make_llm(ckpt, max_num_seqs=2, async_scheduling=async_scheduling)
    engine, log = llm.engine, []
    execute = engine.runner.execute

    def logged(plan):  # type: ignore[no-untyped-def]
        log.append("bookkeeping")
        return execute(plan)

    monkeypatch.setattr(engine.runner, "execute", logged)
    for i in range(2):
        engine.add_request(PROMPTS[i], SamplingParams(max_tokens=5, ignore_eos=True))
    finished = 0
    while finished < 2:
        finished += sum(out.finished for out in engine.step())
    log.append("final outputs")
    assert engine.runner.active_slots()  # not yet freed on the device
    assert not engine.has_unfinished_requests()
    assert log == ["final outputs", "bookkeeping"]
    assert engine.runner.active_slots() == [] and engine.blocks.num_used == 0
    # LLM.generate returns with everything freed
    llm.generate([PROMPTS[2]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.runner.active_slots() == [] and log[-1] == "bookkeeping"


def test_arrivals_between_steps_match_serial(ckpt):
    llm = make_llm(
        ckpt, block_size=2, max_num_seqs=4, max_num_batched_tokens=6, prefill_chunk_size=4
    )
    engine = llm.engine
    finals = {}
    schedule = {0: [0, 1], 3: [2], 5: [3, 4], 11: [5], 17: [6, 7, 8]}
    step = 0
    while step < 18 or engine.has_unfinished_requests():
        for i in schedule.get(step, []):
            engine.add_request(PROMPTS[i], params_for(i), request_id=f"r{i}")
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
    assert sorted(finals) == sorted(f"r{i}" for i in range(9))
    for i, prompt in enumerate(PROMPTS):
        out = finals[f"r{i}"]
        assert (out.token_ids, out.exit_depths) == serial(llm, prompt, params_for(i))


# -- text, stop strings, EOS, stop ids --------------------------------------------------------


def _stream(llm: LLM, prompts, params) -> tuple[list, dict[str, str]]:
    pieces: dict[str, str] = {}

    def collect(out) -> None:
        pieces[out.request_id] = pieces.get(out.request_id, "") + out.new_text

    return llm.generate(prompts, params, on_output=collect), pieces


def test_text_generation_streams_the_final_text(tllm):
    prompts = ["Hello world", "The quick brown fox", "日本語 🙂", "a"]
    outs, pieces = _stream(tllm, prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    tok = tllm.tokenizer
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.prompt_token_ids == tok.encode(prompt)
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        assert pieces[out.request_id] == out.text
        assert len(out.token_ids) == 10 and out.finish_reason == "length"
        m = out.metrics
        assert m.arrival_time <= m.first_token_time <= m.finish_time
        assert m.time_to_first_token is not None and m.time_to_first_token >= 0


def test_stop_string_truncates_text_and_finishes_with_stop(tllm):
    prompt = "The quick brown fox"
    (full,) = tllm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    tok, ids, text = tllm.tokenizer, full.token_ids, full.text
    ends = [len(tok.decode(ids[: i + 1], skip_special_tokens=True)) for i in range(len(ids))]
    # a stop string straddling the boundary between two tokens, first seen there
    for i in range(2, len(ids) - 2):
        cut = ends[i]
        stop = text[cut - 2 : cut + 2]
        if len(stop) == 4 and text.find(stop) == cut - 2 and ends[i + 1] >= cut + 2:
            break
    else:
        pytest.fail(f"no token boundary fits a straddling stop string in {text!r}")
    (out,) = tllm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop=stop))
    assert out.finish_reason == "stop"
    assert out.text == text[: cut - 2]
    assert out.token_ids == ids[: i + 2]  # generation ended on the token completing the stop
    # several stop strings: the earliest match wins
    first_word = text.strip().split()[0]
    (out2,) = tllm.generate(
        [prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop, first_word])
    )
    assert out2.finish_reason == "stop" and out2.text == text[: text.find(first_word)]


def test_stop_string_on_the_last_allowed_token_reports_stop(tllm):
    prompt = "The quick brown fox"
    (full,) = tllm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))
    tok, ids = tllm.tokenizer, full.token_ids
    texts = [tok.decode(ids[:n], skip_special_tokens=True) for n in range(len(ids) + 1)]
    # the n-th token adds text never seen before: make that text the stop and n the limit
    n = next(
        n
        for n in range(2, len(ids) + 1)
        if texts[n].startswith(texts[n - 1])
        and (new := texts[n][len(texts[n - 1]) :]).strip()
        and "\ufffd" not in texts[n]
        and new not in texts[n - 1]
    )
    stop = texts[n][len(texts[n - 1]) :]
    params = SamplingParams(max_tokens=n, ignore_eos=True, stop=stop)
    (out,) = tllm.generate([prompt], params)
    assert out.token_ids == ids[:n]
    assert out.text == texts[n - 1]  # cut at the stop string
    assert out.finish_reason == "stop"


def test_stop_token_ids_end_generation(tllm):
    prompt = "Once upon a time"
    (full,) = tllm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))
    ids = full.token_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    (out,) = tllm.generate([prompt], SamplingParams(max_tokens=10, stop_token_ids=[ids[k]]))
    assert out.token_ids == ids[: k + 1] and out.finish_reason == "stop"
    assert out.exit_depths == full.exit_depths[: k + 1]


def test_eos_ends_generation_and_ignore_eos_runs_to_max_tokens(tiny_ouro_dir):
    llm = make_llm(tiny_ouro_dir)
    eos = llm.engine.model_config.eos_token_ids[0]
    assert eos in llm.engine.default_stop_ids
    prompt = "Once upon a time"
    (full,) = llm.generate([prompt], SamplingParams(max_tokens=10))
    assert eos not in full.token_ids
    # make EOS the favourite whenever the 4th token's favourite wins by a margin
    lm_head = llm.engine.model.lm_head.weight
    with torch.no_grad():
        lm_head[eos] = 3.0 * lm_head[full.token_ids[3]]
    prompt_ids = llm.tokenizer.encode(prompt)
    want, depths = greedy_decode(llm.engine.model, prompt_ids, 10)
    assert eos in want[:-1], want
    stop_at = want.index(eos)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=10))
    assert out.finish_reason == "stop"
    assert out.token_ids == want[: stop_at + 1] and out.exit_depths == depths[: stop_at + 1]
    assert out.text == llm.tokenizer.decode(want[:stop_at], skip_special_tokens=True)
    (free,) = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))
    assert free.finish_reason == "length" and free.token_ids == want


def test_chat_renders_the_template(tllm):
    messages = [{"role": "user", "content": "Say hi 🙂"}]
    (out,) = tllm.chat(messages, SamplingParams(max_tokens=3, ignore_eos=True))
    assert out.prompt_token_ids == render_chat(tllm.tokenizer, messages)
    assert len(out.token_ids) == 3


def test_outputs_come_back_in_input_order(llm):
    prompts = [PROMPTS[7], PROMPTS[0], PROMPTS[4]]  # long first: finishes last
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 1, 3)]
    outs = llm.generate(prompts, params)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.token_ids) for o in outs] == [6, 1, 3]
    assert len({o.request_id for o in outs}) == 3


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(max_tokens=0), r"max_tokens must be a positive integer, got 0"),
        (dict(temperature=-0.1), r"temperature must be >= 0, got -0\.1"),
        (dict(top_k=-1), r"top_k must be >= 0 \(0 disables it\), got -1"),
        (dict(top_p=0.0), r"top_p must lie in \(0, 1\], got 0\.0"),
        (dict(top_p=1.5), r"top_p must lie in \(0, 1\], got 1\.5"),
        (dict(logprobs=21), r"logprobs must lie in \[0, 20\], got 21"),
        (dict(stop=[""]), r"stop must not hold an empty string"),
        (dict(min_loops=0), r"min_loops must be >= 1, got 0"),
        (dict(max_loops=0), r"max_loops must be >= 1, got 0"),
        (dict(exit_threshold=1.5), r"exit_threshold must lie in \[0, 1\], got 1\.5"),
        (dict(exit_threshold=-0.1), r"exit_threshold must lie in \[0, 1\], got -0\.1"),
        (dict(presence_penalty=2.5), r"presence_penalty must lie in \[-2, 2\], got 2\.5"),
        (dict(frequency_penalty=-3), r"frequency_penalty must lie in \[-2, 2\], got -3"),
        (dict(frequency_penalty=float("nan")), r"frequency_penalty must lie in \[-2, 2\]"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be a finite number > 0"),
        (dict(repetition_penalty=float("inf")), r"repetition_penalty must be a finite number"),
        (dict(min_tokens=-1), r"min_tokens must be an integer in \[0, max_tokens\], got -1"),
        (dict(max_tokens=4, min_tokens=5), r"got 5 \(max_tokens=4\)"),
    ],
)
def test_bad_sampling_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_min_tokens_edits_logits_only_where_it_holds_back_a_stop_id():
    assert SamplingParams(min_tokens=3).edits_logits  # the model's EOS
    assert SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[5]).edits_logits
    assert not SamplingParams(min_tokens=3, ignore_eos=True).edits_logits  # nothing to hold
    assert not SamplingParams(min_tokens=0).edits_logits


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(min_loops=3, max_loops=2), "min_loops"),
        (dict(max_loops=DEPTH + 1), "max_loops"),
        (dict(min_loops=DEPTH + 1), "min_loops"),
    ],
)
def test_bad_loop_controls_raise_and_leak_nothing(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPTS[0]], SamplingParams(**kwargs))
    # a bad request in the middle of a batch: the earlier ones are withdrawn
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPTS[:3], [params_for(0), SamplingParams(**kwargs), params_for(2)])


def test_bad_prompts_raise(llm, ckpt):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[5, 49152]], SamplingParams())
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"], SamplingParams())
    with pytest.raises(ValueError, match="context"):
        llm.generate([[5] * 2000], SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request([5], request_id="dup")
        llm.engine.add_request([6], request_id="dup")
    llm.engine.abort_request("dup")


def test_stop_strings_without_a_tokenizer_are_rejected_cleanly(ckpt):
    llm = LLM(str(ckpt), dtype="float32", device="cpu", num_blocks=64)  # not leak-checked
    with pytest.raises(ValueError, match="stop strings"):
        llm.generate([[5, 6]], SamplingParams(stop="x", max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.blocks.num_used == 0


def test_request_that_can_never_fit_is_rejected(ckpt):
    llm = make_llm(ckpt, block_size=2, num_blocks=16)  # 4 planes: at most 8 positions
    (ok,) = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=1))  # 8 positions
    assert len(ok.token_ids) == 1
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([PROMPTS[4]], SamplingParams(max_tokens=2))  # 9 positions
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([PROMPTS[0], PROMPTS[7]], SamplingParams(max_tokens=2))


def test_max_model_len_caps_requests_and_changes_no_output(ckpt, llm):
    """`max_model_len` below the model's 2,048 positions: the engine reports it, refuses a
    request past it by its name, and answers those within it as the uncapped engine does (token
    ids and exit depths, fp32)."""
    capped = make_llm(ckpt, max_model_len=40)
    assert capped.info.max_model_len == 40 and capped.info.max_request_positions == 40
    assert capped.engine.model.config.max_position_embeddings == 40
    # every prompt runs to the cap: 40 positions (its last token is sampled, never run)
    params = [replace(params_for(i), max_tokens=41 - len(q)) for i, q in enumerate(PROMPTS)]
    got = capped.generate(PROMPTS, params)
    want = llm.generate(PROMPTS, params)
    assert [(o.token_ids, o.exit_depths) for o in got] == [
        (o.token_ids, o.exit_depths) for o in want
    ]
    with pytest.raises(ValueError, match=r"max_tokens \(\d+\) exceeds max_model_len=40$"):
        capped.generate([PROMPTS[0]], SamplingParams(max_tokens=42 - len(PROMPTS[0])))
    assert capped.engine.blocks.num_used == 0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(block_size=0), r"block_size must be >= 1, got 0"),
        (dict(num_blocks=0), r"num_blocks must be >= 1, got 0"),
        (dict(max_num_seqs=0), r"max_num_seqs must be >= 1, got 0"),
        (
            dict(max_num_seqs=8, max_num_batched_tokens=4),
            r"max_num_batched_tokens must be >= max_num_seqs",
        ),
        (dict(prefill_chunk_size=0), r"prefill_chunk_size must be >= 1, got 0"),
        (dict(dtype="float64"), r"dtype must be one of .*, got 'float64'"),
        (dict(no_such_option=1), r"unknown engine option\(s\): no_such_option"),
        (dict(max_model_len=0), r"max_model_len must be a positive integer, got 0"),
        (dict(max_model_len=True), r"max_model_len must be a positive integer, got True"),
        (dict(max_model_len=4096), r"max_model_len=4096 exceeds the model's context of 2048"),
    ],
)
def test_bad_engine_options_raise(ckpt, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(ckpt), device="cpu", **options)


def test_info_reports_the_kernel_switches_that_run(ckpt: Path) -> None:
    """`LLM.info.kernels` (and so `rlt bench --json`'s "kernels") says which fast-path switches
    are live: none on the torch backend; on the Triton backend (interpreted here) the fused
    rows (PDL needs sm_90+, the small-GEMM table a GPU of its layout)."""
    off = {"pdl": False, "small_gemm": "cublas", "small_gemm_table": ""}
    torch_llm = make_llm(ckpt)
    assert torch_llm.info.kernels == {**off, "fused_rows": False}
    triton_llm = make_llm(ckpt, attention_backend="triton")
    assert triton_llm.info.kernels == {**off, "fused_rows": True}
