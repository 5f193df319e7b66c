"""GPU-only checks (run on the device: `python -m pytest -m gpu tests/test_gpu.py`)."""

import pytest
import torch

from rlt_engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _run(model_dir, device: str, threshold: float):
    llm = LLM(str(model_dir), dtype="float32", device=device, block_size=4)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, exit_threshold=threshold)
    outs = llm.generate(prompts, params)
    assert llm.engine.blocks.num_used == 0
    return [(o.token_ids, o.exit_depths) for o in outs]


@pytest.mark.parametrize("threshold", [1.0, 0.6])
def test_cuda_engine_matches_cpu_engine_fp32(tiny_ouro_dir, threshold):
    assert _run(tiny_ouro_dir, "cuda", threshold) == _run(tiny_ouro_dir, "cpu", threshold)


@pytest.mark.parametrize("threshold", [1.0, 0.6])
def test_cuda_preemption_in_a_tight_pool_matches_cpu(tiny_ouro_dir, threshold):
    """Incremental KV and preemption (`rlt serve`'s defaults) in a pool that holds about two of
    the six requests: snapshots go to host memory and come back while windows are in flight
    (asynchronous, graphs); the tokens and exit depths are the CPU's, nothing is left behind.
    The pool and lengths are chosen so that the asynchronous schedule preempts too (8 times on
    the CPU): its reservation reaches two windows ahead, so 48 blocks and 12 tokens, which
    preempt synchronously, did not preempt at all on CUDA."""

    def run(device: str, num_blocks: int | None = 56) -> tuple[list, int]:
        llm = LLM(
            str(tiny_ouro_dir),
            dtype="float32",
            device=device,
            block_size=4,
            num_blocks=num_blocks,
            incremental_kv=True,
            enable_preemption=True,
            watermark=0.0,
        )
        prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(6)]
        params = SamplingParams(max_tokens=24, ignore_eos=True, exit_threshold=threshold)
        outs = llm.generate(prompts, params)
        engine = llm.engine
        assert engine.blocks.num_used == 0 and engine.runner.snapshots == {}
        return [(o.token_ids, o.exit_depths) for o in outs], engine.cache_stats()["preemptions"]

    cuda, preemptions = run("cuda")
    assert preemptions > 0
    assert cuda == run("cpu")[0] == run("cpu", num_blocks=None)[0]  # tight = roomy


def test_cuda_seeded_sampling_is_batch_invariant(tiny_ouro_dir):
    llm = LLM(str(tiny_ouro_dir), dtype="float32", device="cuda")
    p = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], p)[0].token_ids
    other = SamplingParams(max_tokens=7, temperature=1.0, seed=3, ignore_eos=True)
    batched = llm.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4]], [other, p, other])[1].token_ids
    assert alone == batched


# tokens the tiny Ouro's rows 4 and 5 below repeat from their first tokens on
STOPS = (22481, 44225)


def test_cuda_penalized_greedy_matches_cpu_in_a_tight_pool(tiny_ouro_dir):
    """Penalties, a logit bias and min_tokens in the graphs' `logit_edits` variant, beside
    rows without, with slots reused and snapshots carrying each row's `seen` table: the CPU's
    tokens."""

    def run(device: str) -> list:
        llm = LLM(
            str(tiny_ouro_dir), dtype="float32", device=device, block_size=4, num_blocks=56,
            incremental_kv=True, enable_preemption=True, watermark=0.0, max_num_seqs=4,
        )  # fmt: skip
        prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(6)]
        mix = [
            dict(repetition_penalty=1.8), dict(frequency_penalty=2.0), {},
            dict(presence_penalty=-2.0, repetition_penalty=0.6, logit_bias={7: 3.0, 400: -2.0}),
            dict(min_tokens=12, stop_token_ids=STOPS), dict(min_tokens=3, stop_token_ids=STOPS),
        ]  # fmt: skip
        params = [
            SamplingParams(max_tokens=24, ignore_eos=True, exit_threshold=0.6, **mix[i])
            for i in range(6)
        ]
        outs = llm.generate(prompts, params)
        assert llm.engine.blocks.num_used == 0 and llm.engine.runner.snapshots == {}
        return [(o.token_ids, o.exit_depths, o.finish_reason) for o in outs]

    cpu = run("cpu")
    assert [finish for _, _, finish in cpu[4:]] == ["stop", "stop"]  # after min_tokens
    assert run("cuda") == cpu


def test_cuda_structured_output_matches_cpu():
    """Grammar masks in the graphs' `logit_edits` variant, rows held after each token until
    the host's next mask, asynchronous scheduling: the CPU's tokens, beside free rows."""
    from rlt_engine.sampling_params import StructuredOutput

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    specs = [
        StructuredOutput(choice=("yes", "no")), None, StructuredOutput(regex="[a-z ]+"),
        StructuredOutput(json=schema), StructuredOutput(json_object=True), None,
    ]  # fmt: skip

    def run(device: str) -> list:
        llm = LLM("demo", dtype="float32", device=device, max_num_seqs=4, block_size=4)
        prompts = [f"Q: {i} + {i} =" for i in range(6)]
        outs = llm.generate(prompts, [SamplingParams(max_tokens=24, structured=s) for s in specs])
        assert llm.engine.blocks.num_used == 0
        return [(o.token_ids, o.exit_depths, o.finish_reason) for o in outs]

    assert run("cuda") == run("cpu")


def test_cuda_prompt_logprobs_match_cpu(tiny_ouro_dir):
    """Prompt logprobs on the prefill path beside decoding rows (graphs, async): the CPU's
    values, and the same tokens."""

    def run(device: str) -> list:
        llm = LLM(str(tiny_ouro_dir), dtype="float32", device=device, block_size=4)
        prompts = [[(5 * i + j) % 700 + 3 for j in range(9 + 7 * i)] for i in range(4)]
        params = [
            SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=(2, None)[i % 2])
            for i in range(4)
        ]
        return llm.generate(prompts, params)

    cuda, cpu = run("cuda"), run("cpu")
    for a, b in zip(cuda, cpu, strict=True):
        assert a.token_ids == b.token_ids
        if b.prompt_logprobs is None:
            continue
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4


def test_cuda_graph_captures_are_counted(tiny_ouro_dir):
    """Start-up captures the common graphs; a new variant (top-k sampling) is captured on
    first use, and the engine's stats count both, with the host time they took."""
    llm = LLM(str(tiny_ouro_dir), dtype="float32", device="cuda")
    start = llm.engine.stats()
    assert start.graphs_captured > 0 and start.graph_capture_s > 0
    assert llm.info.graphs_at_start == start.graphs_captured  # nothing ran since start-up
    p = SamplingParams(max_tokens=4, temperature=0.8, top_k=5, seed=1, ignore_eos=True)
    llm.generate([[5, 6, 7]], p)
    after = llm.engine.stats()
    assert after.graphs_captured > start.graphs_captured
    assert after.graph_capture_s > start.graph_capture_s


def _one_row(model_dir, device: str):
    llm = LLM(str(model_dir), dtype="float32", device=device, block_size=4)
    params = SamplingParams(max_tokens=12, ignore_eos=True, exit_threshold=0.6)
    out = llm.generate([[11, 12, 13, 14, 15, 16, 17]], params)[0]
    return out.token_ids, out.exit_depths


def test_cuda_single_row_with_early_exits_matches_cpu(tiny_ouro_dir):
    """A batch of one with early exits: its exit copies pass one source slot repeated for each
    deeper plane (a stride-0 view the K/V copy kernel once read past)."""
    assert _one_row(tiny_ouro_dir, "cuda") == _one_row(tiny_ouro_dir, "cpu")


@pytest.mark.parametrize("refill", [True, False])
def test_cuda_fused_row_bookkeeping_equals_the_torch_path(tiny_ouro_dir, monkeypatch, refill):
    """kernels/slot_step (prepare, exit rule, advance) and the gated greedy argmax, compiled and
    graph-replayed, against their torch references on the same CUDA engine, in fp32: tokens,
    exit depths, stop-id and max_tokens finishes, adaptive exits with LAST_EXITED copies."""
    from rlt_engine.kernels import slot_step

    prompts = [[(5 * i + j) % 400 + 3 for j in range(4 + 5 * i)] for i in range(7)]

    def params(stops):
        return [
            SamplingParams(
                max_tokens=6 + 3 * i, exit_threshold=(1.0, 0.6, 0.3)[i % 3],
                min_loops=1 + i % 2, stop_token_ids=stops if i % 2 else None, ignore_eos=True,
            )
            for i in range(len(prompts))
        ]  # fmt: skip

    def run(mode, stops):
        monkeypatch.setattr(slot_step, "_MODE", mode)
        llm = LLM(str(tiny_ouro_dir), dtype="float32", device="cuda", block_size=4, refill=refill)
        assert llm.engine.runner.traversal.fused == (mode == "1")
        outs = llm.generate(prompts, params(stops))
        assert llm.engine.blocks.num_used == 0
        return [(o.token_ids, o.exit_depths, o.finish_reason) for o in outs]

    plain = run("0", None)
    stops = [plain[1][0][2], plain[3][0][4]]  # tokens these requests make: they stop early
    fused, reference = run("1", stops), run("0", stops)
    assert fused == reference
    assert {reason for _, _, reason in reference} == {"stop", "length"}


def test_cuda_slots_handed_on_early_match_cpu(tiny_ouro_dir):
    """Async scheduling on CUDA (graphs, fused rows) with a queue: slots and blocks handed to
    queued requests while their previous owners' last windows are still in flight; the same
    tokens and exit depths as the synchronous CPU engine."""
    from engine_helpers import queued_workload

    got, handed = queued_workload(tiny_ouro_dir, "cuda", asynchronous=True)
    want, _ = queued_workload(tiny_ouro_dir, "cpu", asynchronous=False)
    assert handed > 0
    assert got == want


def ouro_decode_at(prompts: list[list[int]], counts=(1, 8, 32)) -> dict[int, list]:
    """Ouro-1.4B's shapes (dummy bf16 weights, CUDA graphs, as many slots as the largest
    count): (token ids, exit depths) of 16 greedy tokens for the first n prompts for each n of
    `counts` (decode rows of 1, 8 and 32: each its own small-GEMM table bucket), each from a
    fresh engine that returns every block."""
    import gc
    from pathlib import Path

    model = Path(__file__).parent / "fixtures" / "ouro-1.4b"
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    runs = {}
    for n in counts:
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(str(model), load_format="dummy", dtype="bfloat16", device="cuda",
                  max_num_seqs=max(counts))  # fmt: skip
        outs = llm.generate(prompts[:n], params)
        assert llm.engine.blocks.num_used == 0
        runs[n] = [(o.token_ids, o.exit_depths) for o in outs]
        del llm
    return runs


def test_cuda_unreduced_split_k_equals_the_gemms_own_sum(monkeypatch):
    """Ouro-1.4B's shapes (dummy bf16 weights, CUDA graphs), decode at 1, 8 and 32 sequences:
    the o_proj's and down_proj's split-K partials summed by the add + norm launch
    (kernels/split_sums) give the tokens and exit depths of the GEMM summing them itself."""
    from rlt_engine.kernels import small_gemm
    from rlt_engine.kernels.split_sums import SplitSums

    taken: list[bool] = []
    real = small_gemm.linear

    def spy(x, w, gate=None, prefetch_whole=False, unreduced=False):
        out = real(x, w, gate, prefetch_whole, unreduced)
        taken.append(isinstance(out, SplitSums))
        return out

    monkeypatch.setattr(small_gemm, "linear", spy)
    prompts = [[(41 * i + 13 * j) % 49000 + 3 for j in range(36 + i)] for i in range(32)]
    unreduced = ouro_decode_at(prompts)
    from rlt_engine.kernels.ws_gemm import available

    cuda = torch.device("cuda")
    if available(cuda) and small_gemm.tuned_for(cuda):  # an H200 or H100 SXM takes the table
        assert any(taken)
    monkeypatch.setattr(
        small_gemm,
        "linear",
        lambda x, w, gate=None, prefetch_whole=False, unreduced=False: real(
            x, w, gate, prefetch_whole
        ),
    )
    assert ouro_decode_at(prompts) == unreduced


def test_cuda_qkv_rope_epilogue_equals_its_own_launch(monkeypatch):
    """Ouro-1.4B's shapes (dummy bf16 weights, CUDA graphs), decode at 1, 8 and 32 sequences:
    RoPE + the K/V write in the qkv GEMM's epilogue (worker/attention's project_attend, taken
    on an H200) gives the tokens and exit depths of their own launch, bit for bit."""
    from rlt_engine.kernels import small_gemm
    from rlt_engine.worker.attention import TritonPagedAttention

    taken: list[bool] = []
    real = small_gemm.linear_rope

    def spy(x, w, rope):
        out = real(x, w, rope)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(small_gemm, "linear_rope", spy)
    prompts = [[(37 * i + 11 * j) % 49000 + 3 for j in range(40 + i)] for i in range(32)]
    fused = ouro_decode_at(prompts)
    from rlt_engine.kernels.ws_gemm import available

    cuda = torch.device("cuda")
    if available(cuda) and small_gemm.tuned_for(cuda):  # an H200 or H100 SXM takes the table
        assert any(taken)
    monkeypatch.setattr(TritonPagedAttention, "project_attend", lambda self, *a: None)
    assert ouro_decode_at(prompts) == fused


def test_cuda_long_context_mha_decode_on_the_rows_kernel_matches_cpu(
    ouro_real_dir, tmp_path, monkeypatch
):
    """Contexts past LONG_CONTEXT keys with one kv head per head (a tiny MHA Ouro, fp32): from
    two sequences on the decode takes the rows kernel split ROWS_SPLIT_BUDGET // n ways, merged
    by its last split, inside the CUDA graphs (one sequence keeps the tensor-core walk); tokens
    and exit depths equal the CPU engine's, early exits on.

    Start-up captures the long-context variant of every batch bucket whatever the workload, so
    what is checked is the choice made for each bucket whose long-context graph a window
    replayed, not every choice made at start-up."""
    from tiny_checkpoints import write_tiny_ouro

    from rlt_engine.kernels import paged_attention as pa
    from rlt_engine.worker.graphs import GraphCache

    model = write_tiny_ouro(tmp_path / "mha", tokenizer_from=ouro_real_dir, num_key_value_heads=4)
    prompts = [[(13 * i + 7 * j) % 900 + 3 for j in range(1030 + 40 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=10, ignore_eos=True, exit_threshold=0.6)
    rows_kernel: dict[int, set[bool]] = {}  # decode sequences -> choices of long-context launches
    rule = pa._rows_wins

    def spy_rule(num_seqs, num_heads, num_splits, long_context):
        wins = rule(num_seqs, num_heads, num_splits, long_context)
        if long_context:
            rows_kernel.setdefault(num_seqs, set()).add(wins)
        return wins

    long_buckets: set[int] = set()  # padded batch sizes of the long-context windows replayed
    replay = GraphCache.replay

    def spy_replay(self, b, flags, traversals, wave=None):
        padded = replay(self, b, flags, traversals, wave)
        if flags.long_context:
            long_buckets.add(padded)
        return padded

    monkeypatch.setattr(pa, "_rows_wins", spy_rule)
    monkeypatch.setattr(GraphCache, "replay", spy_replay)

    def run(device: str, n: int):
        llm = LLM(str(model), dtype="float32", device=device, block_size=16, max_num_seqs=4)
        outs = llm.generate(prompts[:n], params)
        assert llm.engine.blocks.num_used == 0
        return [(o.token_ids, o.exit_depths) for o in outs]

    for n in (1, 3):
        long_buckets.clear()
        assert run("cuda", n) == run("cpu", n)
        assert long_buckets, "no decode window ran past LONG_CONTEXT keys"
        # the graphs replayed past LONG_CONTEXT: one sequence's on the tensor-core walk only,
        # those of two or more with the rows kernel
        for b in long_buckets:
            if b >= pa.ROWS_LONG_SEQS:
                assert True in rows_kernel[b]
            else:
                assert rows_kernel[b] == {False}
        # one sequence keeps the tensor-core walk; three run the rows kernel once all decode
        assert (max(long_buckets) >= pa.ROWS_LONG_SEQS) == (n >= pa.ROWS_LONG_SEQS)
