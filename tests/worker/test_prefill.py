"""Prefill waves (worker/prefill.py): the fixed-shape path (padded buckets, CUDA graphs on the
GPU) computes what the exact-shape path computes."""

import dataclasses

import pytest
import torch

from rlt_engine import LLM, SamplingParams
from rlt_engine.core.plan import PrefillChunk
from rlt_engine.kernels.paged_attention import LONG_CONTEXT
from rlt_engine.worker.decode import Flags
from rlt_engine.worker.prefill import CPU_BUCKETS, CUDA_BUCKETS, MAX_GRAPH_ROWS, WaveLayout


def _chunk(slot: int, start: int, n: int, last: bool = True) -> PrefillChunk:
    return PrefillChunk(f"r{slot}", slot, start, tuple(range(3 + slot, 3 + slot + n)), last)


def test_wave_layout_lists_rows_in_chunk_order():
    wave = WaveLayout.of((_chunk(2, 0, 3), _chunk(0, 4, 2, last=False)))
    assert wave.ids == [5, 6, 7, 3, 4]
    assert wave.positions == [0, 1, 2, 4, 5]
    assert wave.row_seq == [0, 0, 0, 1, 1]
    assert (wave.slots, wave.counts, wave.ends, wave.firsts) == ([2, 0], [3, 2], [3, 6], [0, 3, 5])
    assert wave.rows == 5


def test_pieces_cut_between_chunks_within_the_row_limit():
    wave = WaveLayout.of(tuple(_chunk(slot, 2 * slot, n) for slot, n in enumerate((7, 9, 5, 20))))
    pieces = wave.pieces(16, 8)
    assert [p.counts for p in pieces] == [[7, 9], [5], [20]]  # 20 > 16: a piece alone
    assert [p.slots for p in pieces] == [[0, 1], [2], [3]]
    second = pieces[1]
    assert (second.ids, second.positions) == (wave.ids[16:21], wave.positions[16:21])
    assert (second.row_seq, second.ends, second.firsts) == ([0] * 5, [9], [0, 5])
    assert pieces[0].row_seq == [0] * 7 + [1] * 9 and pieces[0].firsts == [0, 7, 16]
    assert [p.counts for p in wave.pieces(100, 8)] == [[7, 9, 5, 20]]
    # a piece is the layout those chunks make on their own
    assert pieces[2] == WaveLayout.of((_chunk(3, 6, 20),))


def test_pieces_cut_within_the_chunk_limit():
    wave = WaveLayout.of(tuple(_chunk(slot, 0, 1) for slot in range(7)))
    assert [p.slots for p in wave.pieces(512, 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [p.firsts for p in wave.pieces(2, 3)][:2] == [[0, 1, 2], [0, 1, 2]]  # rows: 2


def _runner(tiny_ouro_dir, backend: str):
    llm = LLM(
        str(tiny_ouro_dir), dtype="float32", device="cpu", attention_backend=backend, block_size=4
    )
    return llm, llm.engine.runner


def test_buckets_pad_rows_and_keep_a_padding_sequence(tiny_ouro_dir):
    # a CUDA bucket's sequences: a chunk per 8 rows and the padding one, at most a slot each
    assert [CUDA_BUCKETS.seqs(rows, 256) for rows in CUDA_BUCKETS.rows] == [3, 5, 9, 17, 33, 65]
    assert CUDA_BUCKETS.seqs(512, 8) == 9
    five = WaveLayout.of((_chunk(0, 0, 5),))
    three = WaveLayout.of((_chunk(0, 0, 12), _chunk(1, 0, 1), _chunk(2, 0, 1)))
    assert CUDA_BUCKETS.of(five, 256) == 16
    assert CUDA_BUCKETS.of(three, 256) == 32  # 14 rows, but 3 chunks + the padding one
    assert CUDA_BUCKETS.rows[-1] == CPU_BUCKETS.rows[-1] == MAX_GRAPH_ROWS
    # the CPU's (this runner's): the same path at smaller shapes, a chunk per 2 rows
    _, runner = _runner(tiny_ouro_dir, "triton")
    prefill = runner.prefill
    assert prefill.buckets is CPU_BUCKETS
    assert (prefill.bucket(five), prefill.bucket(three)) == (8, 16)
    two = WaveLayout.of((_chunk(0, 0, 2), _chunk(1, 0, 2)))
    assert CPU_BUCKETS.of(two, 256) == 4  # 3 sequences: 2 chunks and the padding one
    assert CPU_BUCKETS.of(two, 1) is None  # one slot: no room for two chunks
    assert prefill.max_chunks == CPU_BUCKETS.seqs(MAX_GRAPH_ROWS, prefill.num_slots) - 1
    many = WaveLayout.of(tuple(_chunk(s, 0, 1) for s in range(prefill.max_chunks + 1)))
    assert prefill.bucket(many) is None  # more chunks than any bucket has room for
    too_big = WaveLayout.of((_chunk(0, 0, MAX_GRAPH_ROWS + 1),))
    assert prefill.bucket(too_big) is None  # a chunk past the largest bucket: exact shape
    _, torch_runner = _runner(tiny_ouro_dir, "torch")
    assert torch_runner.prefill.bucket(three) is None  # the torch backend: exact shapes only


def test_padded_inputs_live_at_fixed_addresses(tiny_ouro_dir):
    """A captured traversal reads the wave's inputs where its capture found them: two waves of
    one bucket get the same tensors, holding the later wave's values (a fresh dtype conversion
    per wave made a riding wave's graph replay read the first wave's lengths)."""
    _, runner = _runner(tiny_ouro_dir, "triton")
    prefill = runner.prefill
    first = prefill.inputs_for(WaveLayout.of((_chunk(0, 0, 5), _chunk(1, 0, 5))))
    names = ("ids", "positions", "row_seq", "valid", "slot", "seq_len", "query_start")
    views = [getattr(first, name).data_ptr() for name in names]
    second = prefill.inputs_for(WaveLayout.of((_chunk(2, 4, 3), _chunk(0, 0, 6))))
    assert [getattr(second, name).data_ptr() for name in names] == views
    assert second.valid.dtype == torch.bool and second.seq_len.dtype == torch.int32
    assert second.valid.tolist() == [True] * 9 + [False] * 7
    # the padding sequence (the third) sees no keys; the others own no rows
    seqs = prefill.buckets.seqs(16, prefill.num_slots)
    assert second.seq_len.tolist() == [7, 6] + [0] * (seqs - 2)
    assert second.query_start.tolist() == [0, 3, 9] + [16] * (seqs - 2)
    assert second.slot[:2].tolist() == [2, 0]


def test_padded_wave_equals_exact_wave(tiny_ouro_dir):
    """The same wave through the padded path and the exact path (Triton kernels under the
    interpreter): the same hidden states for the real rows, zeros nowhere near them."""
    llm, runner = _runner(tiny_ouro_dir, "triton")
    engine = llm.engine
    prompts = [[7, 8, 9, 10, 11], [12, 13, 14]]
    # admit the requests through the engine so their slots own blocks, then replay the wave
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=1, ignore_eos=True))
    plan = engine.scheduler.schedule()
    engine.runner.execute(plan)
    wave = WaveLayout.of(plan.prefill[0])
    padded = runner.prefill(wave)[: wave.rows].clone()
    exact = runner.prefill._exact(wave)
    assert padded.shape == exact.shape
    assert torch.isfinite(runner.prefill(wave)).all()  # padding rows stay finite
    torch.testing.assert_close(padded, exact, rtol=1e-5, atol=1e-5)


def test_a_wave_past_the_largest_bucket_runs_in_pieces(tiny_ouro_dir, monkeypatch):
    """A wave longer than the largest bucket goes through the buckets in pieces of whole
    chunks (with the largest bucket at 16 rows here): the hidden states of the exact wave."""
    llm, runner = _runner(tiny_ouro_dir, "triton")
    engine = llm.engine
    prompts = [[3 + i for i in range(7)], [20 + i for i in range(9)], [40 + i for i in range(5)]]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=1, ignore_eos=True))
    plan = engine.scheduler.schedule()
    engine.runner.execute(plan)
    wave = WaveLayout.of(plan.prefill[0])
    assert wave.counts == [7, 9, 5]
    runner.prefill.max_rows = 16
    calls = []
    one = runner.prefill._one
    monkeypatch.setattr(runner.prefill, "_one", lambda w: calls.append(w.counts) or one(w))
    pieces = runner.prefill(wave)
    assert calls == [[7, 9], [5]]
    exact = runner.prefill._exact(wave)
    assert pieces.shape == exact.shape
    torch.testing.assert_close(pieces, exact, rtol=1e-5, atol=1e-5)


def _outputs(model_dir, device: str, **opts):
    llm = LLM(str(model_dir), dtype="float32", device=device, block_size=4, **opts)
    prompts = [[(5 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate((3, 17, 40, 9, 70))]
    params = [
        SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=t)
        for t in (1.0, 0.6, 1.0, 0.6, 1.0)
    ]
    outs = [(o.token_ids, o.exit_depths) for o in llm.generate(prompts, params)]
    assert llm.engine.blocks.num_used == 0
    # the number of captured prefill graphs, not the runner: it holds the KV pool (most of
    # the GPU), which the next engine of the test needs
    return outs, len(llm.engine.runner.prefill.graphs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("chunk", [512, 16])
def test_cuda_prefill_graphs_equal_eager_and_cpu(tiny_ouro_dir, chunk):
    graphs, captured = _outputs(tiny_ouro_dir, "cuda", prefill_chunk_size=chunk)
    assert captured, "no prefill wave was captured"
    eager, _ = _outputs(tiny_ouro_dir, "cuda", prefill_chunk_size=chunk, enforce_eager=True)
    assert graphs == eager
    cpu, _ = _outputs(tiny_ouro_dir, "cpu", prefill_chunk_size=chunk)
    assert graphs == cpu


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_common_graphs_are_captured_at_start(tiny_ouro_dir):
    """Default requests after start-up find every graph they need: a lone request, waves of
    several prompts riding beside decode rows (sampled or greedy), and decode rows whose
    context reaches LONG_CONTEXT keys (the attention's other launch plan)."""
    llm = LLM(
        str(tiny_ouro_dir), dtype="float32", device="cuda", max_num_seqs=8, async_scheduling=False
    )
    runner = llm.engine.runner
    decode, prefill = len(runner.graphs.graphs), len(runner.prefill.graphs)
    assert prefill == len(CUDA_BUCKETS.rows)
    assert llm.engine.scheduler.max_ride_rows == MAX_GRAPH_ROWS  # larger waves: in pieces
    # greedy and sampled, each with both attention launch plans: every batch bucket, alone
    # and with a wave of each row bucket riding
    assert decode == 2 * 2 * len(runner.graphs.buckets) * (1 + len(CUDA_BUCKETS.rows))
    llm.generate([[5, 6, 7] * 7], SamplingParams(max_tokens=8, ignore_eos=True))
    llm.generate([list(range(3, 103))], SamplingParams(max_tokens=4, temperature=0.8, seed=1))
    long = [[3 + i % 250 for i in range(LONG_CONTEXT + 10)], [9, 8, 7]]  # past it from the start
    for temperature in (0.0, 0.8):
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=temperature)
        llm.generate(long, params)
    llm.engine.scheduler.trace = []
    prompts = [[3 + (7 * i + j) % 300 for j in range(5 + 9 * i)] for i in range(14)]
    for temperature in (0.0, 0.8):
        params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=temperature)
        llm.generate(prompts, params)
    assert sum(p.wave_rides for p in llm.engine.scheduler.trace) >= 2
    assert (len(runner.graphs.graphs), len(runner.prefill.graphs)) == (decode, prefill)


def test_no_graphs_captured_on_the_cpu(tiny_ouro_dir):
    _, runner = _runner(tiny_ouro_dir, "triton")
    assert runner.graphs is None and runner.prefill.graphs == {}
    assert runner.max_ride_rows is None  # no captured wave shapes: any wave may ride
    assert runner.capture_graphs([]) == 0


def test_start_up_flags_cover_every_attention_launch_plan(tiny_ouro_dir):
    """Triton's decode attention has a launch plan for tables below LONG_CONTEXT keys and one
    for longer ones (a static graph variant): start-up takes both for every default flag, so
    a request whose context grows past LONG_CONTEXT captures nothing while serving. The torch
    backend has one plan."""
    greedy, sampled = Flags(False, False, None, False), Flags(True, False, None, False)
    _, triton = _runner(tiny_ouro_dir, "triton")
    assert triton.startup_flags([greedy, sampled]) == [
        greedy,
        dataclasses.replace(greedy, long_context=True),
        sampled,
        dataclasses.replace(sampled, long_context=True),
    ]
    _, torch_runner = _runner(tiny_ouro_dir, "torch")
    assert torch_runner.startup_flags([greedy, sampled]) == [greedy, sampled]


def _tokens(model_dir, backend: str, prompts, params, max_rows: int | None = None, **opts):
    """Tokens and exit depths of `prompts` on the CPU (Triton under the interpreter), with
    the largest prefill bucket at `max_rows` where given."""
    llm = LLM(
        str(model_dir), dtype="float32", device="cpu", attention_backend=backend, block_size=4,
        **opts,
    )  # fmt: skip
    if max_rows is not None:
        llm.engine.runner.prefill.max_rows = max_rows
    return [(o.token_ids, o.exit_depths) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("kv_layout", ["last_exited", "shared"])
def test_padded_waves_match_the_torch_backend_in_chunks(tiny_ouro_dir, kv_layout):
    """Chunked prompts (chunks that start mid-prompt, several waves) through the padded path
    (Triton kernels under the interpreter) give the torch backend's tokens and exit depths."""
    prompts = [[7, 8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18]]
    params = SamplingParams(max_tokens=3, ignore_eos=True, exit_threshold=0.6)
    opts = dict(prefill_chunk_size=3, kv_layout=kv_layout)
    triton = _tokens(tiny_ouro_dir, "triton", prompts, params, **opts)
    assert triton == _tokens(tiny_ouro_dir, "torch", prompts, params, **opts)


def test_waves_in_pieces_match_the_torch_backend(tiny_ouro_dir, monkeypatch):
    """Waves past the largest bucket (8 rows here) run in pieces, asynchronous scheduling
    (a wave with nothing decoding beside it does not ride a window): the torch backend's
    tokens and exit depths, with prompts that share a piece and a chunk that stands alone."""
    from rlt_engine.worker.prefill import PrefillRunner

    prompts = [[7, 8, 9, 10, 11], [14, 15, 16], [20 + i for i in range(11)], [30, 31]]
    params = SamplingParams(max_tokens=3, ignore_eos=True, exit_threshold=0.6)
    pieces: list[list[int]] = []
    one = PrefillRunner._one
    monkeypatch.setattr(PrefillRunner, "_one", lambda r, w: pieces.append(w.counts) or one(r, w))
    triton = _tokens(tiny_ouro_dir, "triton", prompts, params, 8, async_scheduling=True)
    assert triton == _tokens(tiny_ouro_dir, "torch", prompts, params, async_scheduling=True)
    assert pieces[:3] == [[5, 3], [11], [2]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_waves_in_pieces_equal_cpu(tiny_ouro_dir, monkeypatch):
    """Waves past the largest bucket (16 rows here) through the captured buckets in pieces,
    and a chunk longer than that at its exact shape: the CPU's tokens."""
    from rlt_engine.worker.prefill import PrefillRunner

    cpu, _ = _outputs(tiny_ouro_dir, "cpu")
    init = PrefillRunner.__init__

    def small(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.max_rows = 16

    monkeypatch.setattr(PrefillRunner, "__init__", small)
    graphs, captured = _outputs(tiny_ouro_dir, "cuda")
    assert captured
    assert graphs == cpu
