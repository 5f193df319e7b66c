"""A prefill wave riding the first `depth` traversals of a decode window (worker/decode.py's
RidingWave): its rows share the decode rows' traversals instead of a pass of their own per
loop. The same tokens, exit depths and logprobs as the wave run before the window, on both
backends (Triton under the interpreter), synchronous and asynchronous, and the plans say it
happened."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import oracle_greedy

from rlt_engine import LLM, SamplingParams
from rlt_engine.core.plan import PrefillChunk, StepPlan


def _workload(
    n: int = 10, seed: int = 0, max_tokens: int = 12
) -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed requests: prompts of 2..29 tokens; greedy and seeded sampling; fixed depth and
    early exits; logprobs or not; one-token requests (their first token is their last) and a
    stop id."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randrange(2, 30))] for _ in range(n)]
    params = [
        SamplingParams(
            max_tokens=1 if i % 5 == 4 else rng.randrange(2, max_tokens),
            ignore_eos=True,
            exit_threshold=rng.choice([1.0, 0.6, 0.3]),
            temperature=rng.choice([0.0, 0.8]),
            seed=i,
            logprobs=rng.choice([None, 2]),
            stop_token_ids=[rng.randrange(3, 400)] if i % 3 == 0 else None,
        )
        for i in range(n)
    ]
    return prompts, params


def _run(llm: LLM, ride: bool, prompts, params) -> tuple[list, list[StepPlan]]:  # type: ignore[no-untyped-def]
    engine = llm.engine
    engine.scheduler.ride_waves = ride
    engine.scheduler.trace = []
    outs = llm.generate(prompts, params)
    assert engine.blocks.num_used == 0 and engine.runner.active_slots() == []
    got = []
    for o in outs:
        lps = o.logprobs or []
        ids = [(lp.token_id, *(i for i, _ in lp.top)) for lp in lps]
        values = [v for lp in lps for v in (lp.logprob, *(v for _, v in lp.top))]
        got.append(((o.token_ids, o.exit_depths, o.finish_reason, ids), values))
    return got, engine.scheduler.trace


@pytest.mark.parametrize(
    ("backend", "asynchronous"), [("torch", False), ("torch", True), ("triton", False)]
)
def test_riding_waves_give_the_same_outputs(tiny_ouro_dir, backend, asynchronous):
    # the interpreter is slow: fewer, shorter requests on the Triton backend
    prompts, params = _workload() if backend == "torch" else _workload(4, max_tokens=5)
    opts = dict(
        dtype="float32",
        device="cpu",
        block_size=4,
        # refills: waves arrive while others decode; on Triton the first wave has three
        # prompts, whose first tokens pad to the bucket's sequences (repeating the first)
        max_num_seqs=4 if backend == "torch" else 3,
        async_scheduling=asynchronous,
    )
    llm = LLM(str(tiny_ouro_dir), attention_backend=backend, **opts)
    riding, riding_plans = _run(llm, True, prompts, params)
    # the waves that do not ride: on the torch backend for Triton too, which the interpreter
    # is slow to repeat (triton = torch: test_engine_equivalence)
    if backend != "torch":
        llm = LLM(str(tiny_ouro_dir), attention_backend="torch", **opts)
    plain, plain_plans = _run(llm, False, prompts, params)
    assert not any(p.wave_rides for p in plain_plans)
    rode = [p for p in riding_plans if p.wave_rides]
    assert len(rode) >= 2, "the workload should make waves ride"
    assert any(c.last for p in rode for c in p.prefill[0])
    # logprobs to 1e-5 (the riding rows go through GEMMs of another height), the rest exactly
    assert [exact for exact, _ in riding] == [exact for exact, _ in plain]
    for (_, got), (_, want) in zip(riding, plain, strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_mid_prompt_waves_ride_disarmed_in_the_same_graph_shape(tiny_ouro_dir):
    """Prompts in chunks of 4 (Triton's fixed-shape path, under the interpreter): a riding wave
    of mid-prompt chunks only runs the bucket's riding traversal disarmed (its gated coda,
    nothing started), and the next wave that ends prompts is armed again: the outputs of
    waves that do not ride (on the torch backend, which the interpreter is slow to repeat)."""
    prompts = [[5, 6, 7], [8 + i for i in range(9)]]  # the second: chunks of 4, 4, 1
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=1, exit_threshold=0.6)
        for n, t in ((10, 0.0), (3, 0.8))
    ]
    opts = dict(
        dtype="float32", device="cpu", block_size=4, max_num_seqs=2, prefill_chunk_size=4,
        decode_window=4, async_scheduling=False,
    )  # fmt: skip
    llm = LLM(str(tiny_ouro_dir), attention_backend="triton", **opts)
    riding, plans = _run(llm, True, prompts, params)
    plain, _ = _run(
        LLM(str(tiny_ouro_dir), attention_backend="torch", **opts), False, prompts, params
    )
    ends = [any(c.last for c in p.prefill[0]) for p in plans if p.wave_rides]
    assert False in ends and True in ends[ends.index(False) :], ends
    assert [exact for exact, _ in riding] == [exact for exact, _ in plain]
    for (_, got), (_, want) in zip(riding, plain, strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_riding_waves_match_the_dense_oracle(tiny_ouro_dir):
    """Greedy requests (fixed depth and early exits) through riding waves against the dense
    fp32 oracle."""
    prompts = [[7 + i, 3, 11 + 2 * i, 5] * (1 + i % 3) for i in range(6)]
    llm = LLM(str(tiny_ouro_dir), dtype="float32", device="cpu", block_size=4, max_num_seqs=2)
    params = [SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=t) for t in (1.0, 0.5)]
    params = [params[i % 2] for i in range(len(prompts))]
    got, plans = _run(llm, True, prompts, params)
    assert sum(p.wave_rides for p in plans) >= 2
    want = [oracle_greedy(llm, prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    assert [(tokens, depths) for (tokens, depths, *_), _ in got] == want


def test_waves_do_not_ride_where_they_cannot(tiny_ouro_dir):
    """No-refill cohorts, SHARED (a wave per prompt token), windows shorter than the depth,
    traversals that would pass max_num_batched_tokens rows."""
    prompts, params = _workload(6, seed=1)
    budget = dict(max_num_batched_tokens=16)  # >= max_num_seqs; most prompts + slots exceed it
    for opts in (dict(refill=False), dict(kv_layout="shared"), dict(decode_window=2), budget):
        llm = LLM(str(tiny_ouro_dir), dtype="float32", device="cpu", max_num_seqs=3, **opts)
        _, plans = _run(llm, True, prompts, params)
        multi = [p for p in plans if len(p.prefill) > 1]
        assert not any(p.wave_rides for p in plans if opts.get("refill", True) is False)
        assert not any(p.wave_rides for p in multi)
        assert all(
            p.decode_traversals >= llm.engine.model_config.num_loops for p in plans if p.wave_rides
        )
        if "decode_window" in opts:
            assert not any(p.wave_rides for p in plans)
        span = llm.engine.config.scheduler.max_num_seqs
        rows = [p.num_prefill_tokens + span for p in plans if p.wave_rides]
        assert all(n <= llm.engine.config.scheduler.max_num_batched_tokens for n in rows)
        if opts is budget:
            assert any(p.prefill and not p.wave_rides for p in plans)


def test_a_riding_plan_the_worker_cannot_run_is_refused(tiny_ouro_dir):
    llm = LLM(str(tiny_ouro_dir), dtype="float32", device="cpu", block_size=4)
    chunk = PrefillChunk("x", 0, 0, (5, 6, 7), last=True)
    bad = StepPlan(prefill=((chunk,), (chunk,)), decode_traversals=8, wave_rides=True)
    with pytest.raises(ValueError, match="exactly one wave"):
        llm.engine.runner.execute(bad)
    short = StepPlan(prefill=((chunk,),), decode_traversals=1, wave_rides=True)
    with pytest.raises(ValueError, match="window of >= 4"):
        llm.engine.runner.execute(short)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_riding_waves_equal_plain_waves_and_the_cpu(tiny_ouro_dir):
    """On the GPU without graphs (--enforce-eager), Triton kernels compiled:
    riding = not riding = the CPU, fp32."""
    prompts, params = _workload()
    opts = dict(dtype="float32", block_size=4, max_num_seqs=4, async_scheduling=False)
    llm = LLM(str(tiny_ouro_dir), device="cuda", enforce_eager=True, **opts)
    plain, _ = _run(llm, False, prompts, params)
    riding, plans = _run(llm, True, prompts, params)
    del llm
    torch.cuda.empty_cache()
    assert sum(p.wave_rides for p in plans) >= 3
    cpu, _ = _run(LLM(str(tiny_ouro_dir), device="cpu", **opts), True, prompts, params)
    for got in (riding, cpu):
        assert [exact for exact, _ in got] == [exact for exact, _ in plain]
        for (_, values), (_, want) in zip(got, plain, strict=True):
            assert values == pytest.approx(want, abs=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("seed", "asynchronous"), [(0, False), (1, False), (2, True)])
def test_cuda_riding_graphs_equal_eager_plain_waves(tiny_ouro_dir, seed, asynchronous):
    """The riding traversals captured per wave shape: graphs with riding waves = eager
    without, fp32, and riding graphs were captured. (Each workload caught a riding graph that
    read the lengths of the wave it was captured on at every later replay.)"""
    prompts, params = _workload(seed=seed)
    opts = dict(dtype="float32", block_size=4, max_num_seqs=4)
    llm = LLM(str(tiny_ouro_dir), device="cuda", async_scheduling=asynchronous, **opts)
    riding, plans = _run(llm, True, prompts, params)
    graphs = llm.engine.runner.graphs.graphs
    assert sum(p.wave_rides for p in plans) >= 3
    assert any(key[2] is not None for key in graphs)  # riding graphs were captured
    del llm, graphs
    torch.cuda.empty_cache()
    eager = LLM(
        str(tiny_ouro_dir), device="cuda", enforce_eager=True, async_scheduling=False, **opts
    )
    plain, _ = _run(eager, False, prompts, params)
    assert [exact for exact, _ in riding] == [exact for exact, _ in plain]
    for (_, values), (_, want) in zip(riding, plain, strict=True):
        assert values == pytest.approx(want, abs=1e-5)
