"""The engine end to end on CPU in fp32 with tiny models.

Batched generation must equal serial single-request generation (token ids AND exit depths)
for every scheduling policy, chunked-prefill budget and block size; fixed-depth and adaptive
greedy must equal the dense oracle; abort frees everything at every stage; seeded sampling is
batch-invariant; stop strings, EOS and stop ids end generation correctly. After every test no
engine holds a KV block.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_checkpoints import write_tiny_ouro

from rlt_engine import LLM, SamplingParams
from rlt_engine.core.exit_rule import LoopControls
from rlt_engine.core.plan import Stage
from rlt_engine.models.contiguous_kv import greedy_decode
from rlt_engine.models.reference import reference_forward, reference_greedy
from rlt_engine.models.tokenizer import render_chat

DEPTH = 4  # the tiny Ouro's total_ut_steps

_ENGINES: list[LLM] = []  # every LLM a test made or used: checked for leaks after each test


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is much faster, and immune to a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_blocks_in_use_after_each_test() -> Iterator[None]:
    yield
    for llm in _ENGINES:
        assert llm.engine.blocks.num_used == 0, "KV blocks leaked"
        assert not llm.engine.has_unfinished_requests()
    _ENGINES.clear()


def make_llm(path: Path, **options: Any) -> LLM:
    llm = LLM(str(path), dtype="float32", device="cpu", **{"num_blocks": 512, **options})
    _ENGINES.append(llm)
    return llm


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Ouro weights without a tokenizer: loads in milliseconds (token-id prompts)."""
    return write_tiny_ouro(tmp_path_factory.mktemp("tiny-ouro-ids"), tokenizer_from=None)


@pytest.fixture(scope="module")
def base(ckpt: Path) -> LLM:
    """One default engine shared by tests that do not care about engine options."""
    return LLM(str(ckpt), dtype="float32", device="cpu", num_blocks=512)


@pytest.fixture
def llm(base: LLM) -> LLM:
    _ENGINES.append(base)
    return base


@pytest.fixture(scope="module")
def text_llm(tiny_ouro_dir: Path) -> LLM:
    """The tiny Ouro with the real tokenizer, for text, stop strings and chat."""
    return LLM(str(tiny_ouro_dir), dtype="float32", device="cpu", num_blocks=512)


@pytest.fixture
def tllm(text_llm: LLM) -> LLM:
    _ENGINES.append(text_llm)
    return text_llm


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


# -- batched == serial -----------------------------------------------------------------------

ENGINE_CONFIGS = [
    dict(refill=True, block_size=1, max_num_seqs=4, max_num_batched_tokens=4, prefill_chunk_size=2),
    dict(
        refill=True, block_size=2, max_num_seqs=9, max_num_batched_tokens=11, prefill_chunk_size=5
    ),
    dict(refill=True, block_size=16),  # default budget: every prompt in one chunk
    dict(refill=True, block_size=2, num_blocks=64, max_num_seqs=9, max_num_batched_tokens=16),
    dict(
        refill=False, block_size=1, max_num_seqs=9, max_num_batched_tokens=16, prefill_chunk_size=7
    ),
    dict(
        refill=False, block_size=2, max_num_seqs=3, max_num_batched_tokens=3, prefill_chunk_size=3
    ),
    dict(
        refill=False, block_size=16, max_num_seqs=9, max_num_batched_tokens=9, prefill_chunk_size=1
    ),
    dict(refill=False, block_size=16, num_blocks=12),  # the pool holds one request at a time
]


@pytest.mark.parametrize(
    "options",
    ENGINE_CONFIGS,
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_batched_equals_serial(ckpt, options):
    llm = make_llm(ckpt, **options)
    params = [params_for(i) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    check_against_serial(llm, outs, PROMPTS, params)
    depths = {d for o in outs for d in o.exit_depths[1:]}
    assert depths == {1, 2, 3, 4}, "the workload must really mix exit depths"


def test_batched_equals_single_request_runs_of_the_same_engine(ckpt):
    batched = make_llm(ckpt, block_size=2, max_num_seqs=9, max_num_batched_tokens=9)
    params = [params_for(i) for i in range(len(PROMPTS))]
    outs = batched.generate(PROMPTS, params)
    single = make_llm(ckpt, block_size=16)
    for prompt, p, out in zip(PROMPTS, params, outs, strict=True):
        (alone,) = single.generate([prompt], p)
        assert (alone.token_ids, alone.exit_depths) == (out.token_ids, out.exit_depths)


def test_gateless_nanbeige_batched_equals_serial(tiny_nanbeige_dir):
    llm = make_llm(tiny_nanbeige_dir, block_size=2, max_num_seqs=4, max_num_batched_tokens=6)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(5)
    prompts = [[rng.randrange(3, vocab - 3) for _ in range(n)] for n in (1, 4, 9, 6, 2)]
    params = [
        SamplingParams(max_tokens=5, ignore_eos=True, max_loops=m, exit_threshold=t)
        for m, t in ((1, 1.0), (2, 0.1), (1, 0.5), (2, 1.0), (2, 0.0))
    ]
    outs = llm.generate(prompts, params)
    for out, prompt, p in zip(outs, prompts, params, strict=True):
        controls = LoopControls(1, p.max_loops, p.exit_threshold)
        want = greedy_decode(llm.engine.model, prompt, p.max_tokens, controls)
        assert (out.token_ids, out.exit_depths) == want
        assert out.exit_depths[1:] == [p.max_loops] * 4  # no gate: always max_loops


# -- against the dense oracle -----------------------------------------------------------------


def test_fixed_depth_greedy_equals_dense_oracle(llm):
    prompts = PROMPTS[1:5]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    sd, cfg = llm.engine.model.state_dict(), llm.engine.model_config
    for out, prompt in zip(outs, prompts, strict=True):
        assert (out.token_ids, out.exit_depths) == reference_greedy(sd, cfg, prompt, 5)
        assert out.exit_depths == [DEPTH] * 5


def test_adaptive_exit_with_per_request_thresholds_equals_dense_oracle(llm):
    chosen = [1, 3, 4, 7, 2]  # thresholds 0.3, 0.4 (min 2), 0.6 (max 3), 0.2, 0.5
    prompts = [PROMPTS[i] for i in chosen]
    params = [params_for(i) for i in chosen]
    outs = llm.generate(prompts, params)
    sd, cfg = llm.engine.model.state_dict(), llm.engine.model_config
    for out, prompt, p in zip(outs, prompts, params, strict=True):
        want = reference_greedy(
            sd,
            cfg,
            prompt,
            p.max_tokens,
            min_loops=p.min_loops,
            max_loops=p.max_loops,
            exit_threshold=p.exit_threshold,
        )
        assert (out.token_ids, out.exit_depths) == want
    mixed = [o for o in outs if len(set(o.exit_depths[1:])) > 1]
    assert len(mixed) >= 2, [o.exit_depths for o in outs]
    assert len({d for o in outs for d in o.exit_depths[1:]}) >= 3


def test_logprobs_match_the_dense_oracle(llm):
    prompt, p = PROMPTS[4], params_for(2, logprobs=3)
    (out,) = llm.generate([prompt], p)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    ref = reference_forward(
        llm.engine.model.state_dict(),
        llm.engine.model_config,
        prompt + out.token_ids[:-1],
        [DEPTH] * len(prompt) + out.exit_depths[1:],
    )
    for i, (lp, token, depth) in enumerate(
        zip(out.logprobs, out.token_ids, out.exit_depths, strict=True)
    ):
        full = ref.logits[depth - 1, len(prompt) - 1 + i].log_softmax(-1)
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(full[token]), abs=1e-4)
        assert [t for t, _ in lp.top] == full.topk(3).indices.tolist()
        assert lp.top[0][0] == token  # greedy: the chosen token is the best one
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
    (plain,) = llm.generate([prompt], params_for(2))
    assert plain.logprobs is None and plain.token_ids == out.token_ids


# -- loop-level batching trace ----------------------------------------------------------------


def test_trace_rows_at_different_depths_share_one_recurrent_batch(llm):
    sched = llm.engine.scheduler
    sched.trace = []
    try:
        params = [params_for(i) for i in range(len(PROMPTS))]
        outs = llm.generate(PROMPTS, params)
        trace = sched.trace
    finally:
        sched.trace = None
    check_against_serial(llm, outs, PROMPTS, params)
    prompt_len = {o.request_id: len(o.prompt_token_ids) for o in outs}
    mixed = []
    for plan in trace:
        if plan.stage is not Stage.RECURRENT:
            continue
        decode_loops = {r.loop for r in plan.rows if r.start >= prompt_len[r.request_id]}
        if len(decode_loops) > 1:
            mixed.append(plan)
    assert mixed, "no RECURRENT batch held decode rows at different loop indices"
    assert any(0 in {r.loop for r in p.rows} and max(r.loop for r in p.rows) >= 2 for p in mixed)
    assert any(p.stage is Stage.CODA for p in trace)  # adaptive exits get their own CODA step


def test_trace_no_refill_decode_rows_share_one_loop(ckpt):
    llm = make_llm(ckpt, refill=False)
    llm.engine.scheduler.trace = []
    params = [params_for(i) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    check_against_serial(llm, outs, PROMPTS, params)
    prompt_len = {o.request_id: len(o.prompt_token_ids) for o in outs}
    for plan in llm.engine.scheduler.trace:
        if plan.stage is Stage.RECURRENT:
            loops = {r.loop for r in plan.rows if r.start >= prompt_len[r.request_id]}
            assert len(loops) <= 1, plan


# -- abort ----------------------------------------------------------------------------------


def _find(llm: LLM, rid: str):
    sched = llm.engine.scheduler
    return next((r for r in (*sched.waiting, *sched.running) if r.request_id == rid), None)


STAGE_REACHED = {
    "waiting": lambda r: r is not None and r.stage is Stage.WAITING,
    "prefill_mid_chunk": lambda r: (
        r is not None and r.stage is Stage.PREFILL and r.num_prefilled > 0 and r.loop > 0
    ),
    "recurrent_mid_loop": lambda r: r is not None and r.stage is Stage.RECURRENT and r.loop > 0,
    "coda_pending": lambda r: r is not None and r.stage is Stage.CODA,
    "finished": lambda r: r is None,
}


@pytest.mark.parametrize("stage", list(STAGE_REACHED))
def test_abort_at_every_stage_frees_everything(ckpt, stage):
    llm = make_llm(
        ckpt, block_size=2, max_num_seqs=2, max_num_batched_tokens=8, prefill_chunk_size=3
    )
    engine = llm.engine
    neighbour = SamplingParams(max_tokens=5, ignore_eos=True, exit_threshold=0.5)
    engine.add_request(PROMPTS[3], neighbour, request_id="n")
    if stage == "waiting":  # a third request waits behind max_num_seqs
        engine.add_request(PROMPTS[2], neighbour, request_id="m")
    victim = SamplingParams(max_tokens=4, ignore_eos=True, exit_threshold=0.0, min_loops=1)
    if stage == "recurrent_mid_loop":
        victim = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request(PROMPTS[6], victim, request_id="v")
    finals = {}
    engine.step()
    for _ in range(500):
        if STAGE_REACHED[stage](_find(llm, "v")):
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
    # the victim's blocks are back at once: only the neighbours' reservations remain
    blocks = engine.blocks
    running = engine.scheduler.running
    assert blocks.num_used == sum(blocks.blocks_needed(r.max_positions) for r in running)
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


# -- sampling ---------------------------------------------------------------------------------


def test_seeded_sampling_is_batch_invariant(ckpt, llm):
    sampled = SamplingParams(
        max_tokens=8,
        temperature=1.3,
        top_k=200,
        top_p=0.97,
        seed=4321,
        ignore_eos=True,
        exit_threshold=0.5,
    )
    (alone,) = llm.generate([PROMPTS[5]], sampled)
    params = [params_for(i) for i in range(len(PROMPTS))]
    params[5] = sampled
    params[2] = SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True)
    params[7] = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)  # unseeded
    other = make_llm(ckpt, block_size=1, refill=False, max_num_seqs=5, max_num_batched_tokens=7)
    for engine in (llm, other):
        outs = engine.generate(PROMPTS, params)
        assert (outs[5].token_ids, outs[5].exit_depths) == (alone.token_ids, alone.exit_depths)
    (greedy,) = llm.generate([PROMPTS[5]], dataclasses.replace(sampled, temperature=0.0))
    assert alone.token_ids != greedy.token_ids, "not really sampling"
    (reseeded,) = llm.generate([PROMPTS[5]], sampled)
    assert reseeded.token_ids == alone.token_ids
    (other_seed,) = llm.generate([PROMPTS[5]], dataclasses.replace(sampled, seed=99))
    assert other_seed.token_ids != alone.token_ids


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
    "kwargs",
    [
        dict(max_tokens=0),
        dict(temperature=-0.1),
        dict(top_k=-1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(logprobs=21),
        dict(stop=[""]),
        dict(min_loops=0),
        dict(max_loops=0),
        dict(exit_threshold=1.5),
        dict(exit_threshold=-0.1),
    ],
)
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


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


@pytest.mark.parametrize(
    "options",
    [
        dict(block_size=0),
        dict(num_blocks=0),
        dict(max_num_seqs=0),
        dict(max_num_seqs=8, max_num_batched_tokens=4),
        dict(prefill_chunk_size=0),
        dict(dtype="float64"),
        dict(no_such_option=1),
    ],
)
def test_bad_engine_options_raise(ckpt, options):
    with pytest.raises(ValueError):
        LLM(str(ckpt), device="cpu", **options)
