"""The decode traversal's fused row bookkeeping (kernels/slot_step.py and the gated argmax,
interpreted on the CPU) through the whole engine on the Triton backend against the torch
backend (whose traversal runs the torch references): the same tokens, exit depths and finish
reasons with SHARED KV and without refill, with stop ids and max_tokens finishes. The
kernel-level tests
(tests/kernels/test_slot_step.py) cover random states; this covers the wiring."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from engine_helpers import PROMPTS, check_no_blocks_in_use, make_llm, params_for

from rlt_engine.kernels import slot_step


@pytest.fixture(autouse=True)
def _no_leaks():
    yield
    check_no_blocks_in_use()


CASES = [  # refill with LAST_EXITED runs fused in test_engine_equivalence (against the oracle)
    dict(refill=False),
    dict(refill=True, kv_layout="shared"),
]
N = 4  # prompts of 1, 2, 3 and 5 tokens: the interpreter is slow


def _generate(ckpt, stops: list[int] | None, **options):
    llm = make_llm(ckpt, block_size=4, decode_window=3, **options)
    params = [params_for(i, stop_token_ids=stops if i % 2 else None) for i in range(N)]
    outs = llm.generate(PROMPTS[:N], params)
    return llm, [(o.token_ids, o.exit_depths, o.finish_reason) for o in outs]


def _stopped(run, stops: list[int]):
    """The outputs the same requests give with `stops` on the odd ones: each cut after its
    first stop token (outputs do not depend on the batch, so only the cut changes)."""
    out = []
    for i, (tokens, depths, reason) in enumerate(run):
        hit = [j for j, t in enumerate(tokens) if t in stops] if i % 2 else []
        if hit:
            tokens, depths, reason = tokens[: hit[0] + 1], depths[: hit[0] + 1], "stop"
        out.append((tokens, depths, reason))
    return out


@pytest.mark.parametrize("options", CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_fused_rows_equal_the_torch_path(ckpt, monkeypatch, options):
    """The torch backend (torch references of the row bookkeeping, torch attention) against
    the Triton backend with the fused rows: fp32 outputs are equal across backends."""
    torch_llm, reference = _generate(ckpt, None, attention_backend="torch", **options)
    assert not torch_llm.engine.runner.traversal.fused
    stops = [reference[1][0][1], reference[3][0][2]]  # tokens these requests make: early stops
    monkeypatch.setattr(slot_step, "_MODE", "")  # the default: on under the interpreter
    llm, fused = _generate(ckpt, stops, attention_backend="triton", **options)
    assert llm.engine.runner.traversal.fused
    assert fused == _stopped(reference, stops)
    assert {reason for _, _, reason in fused} == {"stop", "length"}


def test_rows_kernel_with_rope_write_equals_the_torch_path(tmp_path, monkeypatch):
    """MHA decode on the register attention kernel, which rotates q and k and writes the new
    K/V itself (paged_attention's `rope_write`; the engine takes it from 512 programs, forced
    here for a tiny batch), with early exits and their copies: the same tokens and exit depths
    as the torch backend."""
    from tiny_checkpoints import write_tiny_ouro

    from rlt_engine.kernels import paged_attention

    mha = write_tiny_ouro(tmp_path / "mha", tokenizer_from=None, num_key_value_heads=4)
    _, reference = _generate(mha, None, attention_backend="torch")
    launches = []
    real = paged_attention._launch

    def spy(*args, **kwargs):
        launches.append(kwargs.get("rope_write") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(slot_step, "_MODE", "")
    monkeypatch.setattr(paged_attention, "_rows_wins", lambda *args: True)
    monkeypatch.setattr(paged_attention, "_launch", spy)
    _, fused = _generate(mha, None, attention_backend="triton")
    assert fused == reference
    assert any(launches) and not all(launches)  # decode fused; prefill chunks as before


def test_split_rows_kernel_below_long_context_equals_the_torch_path(tmp_path, monkeypatch):
    """MHA decode batches of ROWS_SHORT_SEQS to SPLIT_SEQS sequences below LONG_CONTEXT keys run
    the rows kernel split ROWS_SPLIT_BUDGET // n ways, merged by the last split (here from 2
    sequences on, split 2 ways: the interpreter is slow), with early exits and their copies:
    the torch backend's tokens and exit depths. Contexts of 13-28 keys: two 16-key tiles."""
    from tiny_checkpoints import write_tiny_ouro

    from rlt_engine.kernels import paged_attention

    mha = write_tiny_ouro(tmp_path / "mha", tokenizer_from=None, num_key_value_heads=4)
    chosen = [5, 6, 7]  # prompts of 13, 17 and 21 tokens

    def run(backend: str):
        llm = make_llm(mha, block_size=4, decode_window=3, attention_backend=backend)
        outs = llm.generate([PROMPTS[i] for i in chosen], [params_for(i) for i in chosen])
        return [(o.token_ids, o.exit_depths) for o in outs]

    reference = run("torch")
    picks = []
    real = paged_attention._rows_wins

    def spy(num_seqs, num_heads, num_splits, long_context):
        won = real(num_seqs, num_heads, num_splits, long_context)
        picks.append((num_seqs, num_splits, long_context, won))
        return won

    monkeypatch.setattr(slot_step, "_MODE", "")
    monkeypatch.setattr(paged_attention, "ROWS_SHORT_SEQS", 2)
    monkeypatch.setattr(paged_attention, "ROWS_SPLIT_BUDGET", 6)
    monkeypatch.setattr(paged_attention, "_rows_wins", spy)
    assert run("triton") == reference
    assert (3, 2, False, True) in picks  # three sequences, short, split on the rows kernel


def test_rope_table_covers_requests_to_the_last_position(tmp_path, monkeypatch):
    """The fast path gathers RoPE's cos / sin from a table over the model's context: requests
    that run to its last position (prompt + max_tokens = context) decode as on the torch
    backend and nothing indexes past the table (one position short, it fails)."""
    from tiny_checkpoints import write_tiny_ouro

    from rlt_engine.sampling_params import SamplingParams

    short = write_tiny_ouro(tmp_path / "short", tokenizer_from=None, max_position_embeddings=16)
    prompts = [[5, 9, 3], [7] * 9]
    params = [SamplingParams(max_tokens=16 - len(p), ignore_eos=True) for p in prompts]

    def run(backend: str):
        llm = make_llm(short, block_size=4, decode_window=3, attention_backend=backend)
        outs = llm.generate(prompts, params)
        return llm, [(o.token_ids, o.exit_depths, o.finish_reason) for o in outs]

    _, reference = run("torch")
    monkeypatch.setattr(slot_step, "_MODE", "")
    llm, fused = run("triton")
    assert fused == reference
    assert all(len(t) == 16 - len(p) for (t, _, _), p in zip(fused, prompts, strict=True))
    tables = llm.engine.model.model.rotary_emb.tables
    assert [tuple(t.shape[:2]) for t in tables.values()] == [(16, 2)]  # the context


def test_the_tail_launches_only_what_the_window_needs(ckpt, monkeypatch):
    """The fused traversal's launch plan around the layer stack: in a window where no request
    may exit early the exits come from prepare (no exit rule launch), greedy rows draw through
    the lm_head's argmax partials, and the first layer's norm comes with the prepared rows; a
    window with early exits runs the exit rule. Each is a launch the GPU would pay for in every
    traversal (the GPU timing of the tail: benchmarks/trace_timeline.py)."""
    from rlt_engine.sampling_params import SamplingParams

    monkeypatch.setattr(slot_step, "_MODE", "")
    llm = make_llm(ckpt, block_size=4, decode_window=3, attention_backend="triton")
    model, seen = llm.engine.model, {"rule": 0, "normed": [], "greedy": []}
    rule, recurrent, coda = slot_step.exit_rule, model.recurrent, model.coda

    def counting_rule(*args, **options):
        seen["rule"] += 1
        return rule(*args, **options)

    def recording_recurrent(hidden, meta, backend, **options):
        if "rope" in options:  # a decode traversal without a riding wave
            seen["normed"].append(options.get("normed") is not None)
        return recurrent(hidden, meta, backend, **options)

    def recording_coda(hidden, **options):
        seen["greedy"].append(options.get("greedy", False))
        return coda(hidden, **options)

    monkeypatch.setattr(slot_step, "exit_rule", counting_rule)
    monkeypatch.setattr(model, "recurrent", recording_recurrent)
    monkeypatch.setattr(model, "coda", recording_coda)
    fixed = SamplingParams(max_tokens=3, ignore_eos=True, exit_threshold=1.0)
    llm.generate(PROMPTS[:2], [fixed, fixed])
    assert seen["rule"] == 0
    assert seen["normed"] and all(seen["normed"])
    assert True in seen["greedy"]  # decode draws (prefill's first tokens: logits)
    llm.generate(PROMPTS[:2], [params_for(1), params_for(2)])  # thresholds 0.3 and 0.5
    assert seen["rule"] > 0
