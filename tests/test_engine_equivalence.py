"""The engine end to end on CPU in fp32 with tiny models: batching changes nothing.

Batched generation must equal serial single-request generation (token ids AND exit depths)
for every scheduling policy, chunked-prefill budget and block size; fixed-depth and adaptive
greedy must equal the dense oracle; rows at different loop depths share one batch; seeded
sampling is batch-invariant. After every test no engine holds a KV block.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from attention_launches import record_attention_launches
from engine_helpers import (
    DEPTH,
    ENGINES,
    PROMPTS,
    check_against_serial,
    check_no_blocks_in_use,
    make_llm,
    oracle_greedy,
    params_for,
    until_stop,
)

from rlt_engine import LLM, SamplingParams
from rlt_engine.core.exit_rule import LoopControls
from rlt_engine.oracle.contiguous_kv import greedy_decode
from rlt_engine.oracle.reference import reference_forward, reference_greedy


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
    # the Triton attention, fast path and exit-copy kernels (interpreted on the CPU), with
    # adaptive exits at every depth
    dict(refill=True, block_size=4, attention_backend="triton", decode_window=3),
]
# the interpreter is slow: on Triton five of the prompts, which still exit at every depth
INTERPRETED_PROMPTS = [0, 2, 3, 7, 8]


@pytest.mark.parametrize(
    "options",
    ENGINE_CONFIGS,
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_batched_equals_serial(ckpt, options):
    llm = make_llm(ckpt, **options)
    chosen = range(len(PROMPTS))
    if options.get("attention_backend") == "triton":
        chosen = INTERPRETED_PROMPTS
    prompts, params = [PROMPTS[i] for i in chosen], [params_for(i) for i in chosen]
    outs = llm.generate(prompts, params)
    check_against_serial(llm, outs, prompts, params)
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


# fp32 engine logprobs against the oracle's log-softmax: max abs error 2.4e-6 over this test's
# chosen and top-3 values (5.2e-6 over all 81 prompt x loop-control pairs); logprobs of -1..-11
# are a few fp32 ulps apart. 1e-5 is ~4x this test's error (1e-4 allowed ~40x).
LOGPROB_ABS = 1e-5


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
        assert lp.logprob == pytest.approx(float(full[token]), abs=LOGPROB_ABS)
        assert [t for t, _ in lp.top] == full.topk(3).indices.tolist()
        for t, value in lp.top:
            assert value == pytest.approx(float(full[t]), abs=LOGPROB_ABS)
        assert lp.top[0][0] == token  # greedy: the chosen token is the best one
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
    (plain,) = llm.generate([prompt], params_for(2))
    assert plain.logprobs is None and plain.token_ids == out.token_ids


# -- loop-level batching trace ----------------------------------------------------------------


def _traversals(llm, prompts, params) -> list[tuple[list[int], list[bool], list[bool]]]:
    """Generate, recording each decode traversal's (loop, running, exits) per slot."""
    traversal = llm.engine.runner.traversal
    traversal.trace = []
    try:
        outs = llm.generate(prompts, params)
        trace = traversal.trace
    finally:
        traversal.trace = None
    check_against_serial(llm, outs, prompts, params)
    return trace


def test_trace_rows_at_different_depths_share_one_traversal(llm):
    params = [params_for(i) for i in range(len(PROMPTS))]
    trace = _traversals(llm, PROMPTS, params)
    mixed = [
        loops
        for loops, running, _ in trace
        if len({lp for lp, r in zip(loops, running, strict=True) if r}) > 1
    ]
    assert mixed, "no traversal held decode rows at different loop indices"
    assert any(0 in loops and max(loops) >= 2 for loops in mixed)
    # an adaptive exit is sampled in its own traversal: the slot is at loop 0 in the next one
    early = [
        (t, slot)
        for t, (loops, _, exits) in enumerate(trace[:-1])
        for slot, (lp, ex) in enumerate(zip(loops, exits, strict=True))
        if ex and lp + 1 < DEPTH
    ]
    assert early, "no early exit happened"
    assert all(trace[t + 1][0][slot] == 0 for t, slot in early)


def test_trace_no_refill_decode_rows_share_one_loop(ckpt):
    llm = make_llm(ckpt, refill=False)
    params = [params_for(i) for i in range(len(PROMPTS))]
    trace = _traversals(llm, PROMPTS, params)
    assert trace
    for loops, running, _ in trace:
        assert len({lp for lp, r in zip(loops, running, strict=True) if r}) <= 1, loops


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


# -- logit edits: penalties and bias ---------------------------------------------------------

# strong enough that counts left by a slot's earlier request would change the tokens
PENALTY_MIX = [
    dict(repetition_penalty=1.8),
    dict(frequency_penalty=2.0),
    dict(presence_penalty=-2.0, repetition_penalty=0.6, logit_bias={77: 1.5, 5000: -0.5}),
    {},  # rows without edits share the edited traversals unchanged
    dict(frequency_penalty=-1.5, presence_penalty=1.0, repetition_penalty=1.2),
    dict(logit_bias={t: 2.0 for t in range(100, 400, 3)}),
]
NO_PENALTY = dict(
    presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={}
)


def _penalized(i: int, **extra) -> SamplingParams:
    return dataclasses.replace(params_for(i, **extra), max_tokens=10, **PENALTY_MIX[i % 6])


@pytest.mark.parametrize(
    "options",
    [
        dict(block_size=2, max_num_seqs=2),  # a queue: slots reused by later requests
        dict(block_size=4, refill=False, max_num_seqs=9, prefill_chunk_size=3),
        dict(block_size=1, kv_layout="shared", max_num_seqs=3),
        dict(block_size=4, attention_backend="triton", decode_window=3),  # the riding waves
    ],
    ids=["slots-reused", "no-refill", "shared", "triton"],
)
def test_penalized_greedy_equals_the_dense_oracle(ckpt, options):
    llm = make_llm(ckpt, **options)
    chosen = INTERPRETED_PROMPTS if options.get("attention_backend") == "triton" else range(9)
    prompts, params = [PROMPTS[i] for i in chosen], [_penalized(i) for i in chosen]
    layout = options.get("kv_layout", "last_exited")
    outs = llm.generate(prompts, params)
    for out, prompt, p in zip(outs, prompts, params, strict=True):
        assert (out.token_ids, out.exit_depths) == oracle_greedy(llm, prompt, p, layout)
    plain = llm.generate(prompts, [dataclasses.replace(p, **NO_PENALTY) for p in params])
    changed = sum(a.token_ids != b.token_ids for a, b in zip(outs, plain, strict=True))
    assert changed >= len(prompts) // 2, "the edits must change what greedy decodes"


def test_penalized_sampling_is_batch_invariant_and_keeps_raw_logprobs(ckpt, llm):
    sampled = SamplingParams(
        max_tokens=8, temperature=0.5, top_p=0.95, seed=7, ignore_eos=True, logprobs=2,
        presence_penalty=-2.0, repetition_penalty=0.5,
    )  # fmt: skip
    (alone,) = llm.generate([PROMPTS[6]], sampled)
    params = [_penalized(i) for i in range(len(PROMPTS))]
    params[6] = sampled
    other = make_llm(ckpt, block_size=1, refill=False, max_num_seqs=4)
    for engine in (llm, other):
        outs = engine.generate(PROMPTS, params)
        assert (outs[6].token_ids, outs[6].exit_depths) == (alone.token_ids, alone.exit_depths)
        for got, want in zip(outs[6].logprobs, alone.logprobs, strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=LOGPROB_ABS)
    (unpenalized,) = llm.generate([PROMPTS[6]], dataclasses.replace(sampled, **NO_PENALTY))
    assert unpenalized.token_ids != alone.token_ids
    # the logprobs are the raw logits': those of the same tokens without the penalties
    ref = reference_forward(
        llm.engine.model.state_dict(),
        llm.engine.model_config,
        PROMPTS[6] + alone.token_ids[:-1],
        [DEPTH] * len(PROMPTS[6]) + alone.exit_depths[1:],
    )
    for i, (lp, token, depth) in enumerate(
        zip(alone.logprobs, alone.token_ids, alone.exit_depths, strict=True)
    ):
        full = ref.logits[depth - 1, len(PROMPTS[6]) - 1 + i].log_softmax(-1)
        assert lp.logprob == pytest.approx(float(full[token]), abs=LOGPROB_ABS)


def _ten(i: int, **extra) -> SamplingParams:
    return dataclasses.replace(params_for(i), max_tokens=10, **extra)


@pytest.mark.parametrize(
    "options",
    [
        dict(block_size=2, max_num_seqs=2),  # a queue: slots reused by later requests
        dict(block_size=4, attention_backend="triton", decode_window=3),  # the riding waves
    ],
    ids=["slots-reused", "triton"],
)
def test_min_tokens_greedy_equals_the_dense_oracle(ckpt, options):
    """Stop ids chosen among each prompt's own early greedy tokens (its first, second or
    fourth) would end it at once; min_tokens holds them back for its first tokens, on the
    prefill's first token, the riding wave's and every decode window's, and the request then
    stops at the first stop id the oracle (with the same stop ids held back) reaches."""
    llm = make_llm(ckpt, **options)
    chosen = INTERPRETED_PROMPTS if options.get("attention_backend") == "triton" else range(9)
    prompts = [PROMPTS[i] for i in chosen]
    free = llm.generate(prompts, [_ten(i) for i in chosen])
    params = []
    for k, (i, out) in enumerate(zip(chosen, free, strict=True)):
        early = out.token_ids[(0, 1, 3)[k % 3]]
        min_tokens = (0, 2, 5, 9)[k % 4]  # 0: the stop id ends it where it appears
        stops = (early, (early + 1) % 300) if k % 2 else (early,)
        params.append(_ten(i, min_tokens=min_tokens, stop_token_ids=stops))
    outs = llm.generate(prompts, params)
    held = 0
    for out, prompt, p in zip(outs, prompts, params, strict=True):
        want = until_stop(
            *oracle_greedy(llm, prompt, p, options.get("kv_layout", "last_exited")),
            p.stop_token_ids,
        )
        assert (out.token_ids, out.exit_depths, out.finish_reason) == want
        assert len(out.token_ids) >= p.min_tokens
        held += p.min_tokens > 0 and len(out.token_ids) > 4
    assert held >= 2, "min_tokens must keep some requests going past their early stop ids"


def test_two_decode_sequences_on_the_wide_tile_equal_the_oracle(ckpt, monkeypatch):
    """Two decode sequences below LONG_CONTEXT keys take the wide tile (WIDE_TILE_SPLITS ways
    of 128-key tiles) with their older keys read before the wait, as one sequence does; the
    engine on Triton still gives the dense oracle's tokens and exit depths for both."""
    from rlt_engine.kernels import paged_attention as pa

    launches = record_attention_launches(monkeypatch)
    llm = make_llm(ckpt, attention_backend="triton", block_size=4)
    chosen = (3, 7)
    outs = llm.generate([PROMPTS[i] for i in chosen], [params_for(i) for i in chosen])
    for i, out in zip(chosen, outs, strict=True):
        assert (out.token_ids, out.exit_depths) == oracle_greedy(llm, PROMPTS[i], params_for(i))
    seen = [(grid[0], kw["NUM_SPLITS"], kw["EARLY_KEYS"]) for grid, kw in launches]
    assert (2, pa.WIDE_TILE_SPLITS, True) in seen  # two decode rows, one launch
