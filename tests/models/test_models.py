"""The model modules (through the contiguous KV cache) against the dense fp32 oracle."""

from __future__ import annotations

import pytest
import torch

from rlt_engine.core.exit_rule import LoopControls
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.models.configs import parse_config
from rlt_engine.models.registry import model_class
from rlt_engine.oracle.contiguous_kv import ContiguousKVCache, ContiguousMetadata, greedy_decode
from rlt_engine.oracle.reference import ReferenceOutput, reference_forward, reference_greedy

VOCAB = 96

RAW_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "head_dim": 16,  # not hidden/heads (12), as in Nanbeige
    "eos_token_id": 2,
    "bos_token_id": 1,
}
CONFIGS = {
    "ouro": {**RAW_COMMON, "model_type": "ouro", "num_key_value_heads": 4, "total_ut_steps": 4},
    "nanbeige": {**RAW_COMMON, "model_type": "nanbeige", "num_key_value_heads": 2, "num_loops": 3},
    "nanbeige-skipnorm": {
        **RAW_COMMON,
        "model_type": "nanbeige",
        "num_key_value_heads": 2,
        "num_loops": 3,
        "skip_loop_final_norm": True,
    },
}


def _build(name: str, seed: int = 2) -> LoopedCausalLM:
    cfg = parse_config(CONFIGS[name])
    torch.manual_seed(seed)
    model = model_class(cfg.model_type)(cfg).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:  # ones would hide a missing or misplaced norm
                param.copy_(1 + 0.1 * torch.randn_like(param))
        if cfg.has_exit_gate:  # spread hazards so adaptive exits really vary
            gate = model.model.early_exit_gate
            gate.weight.mul_(12.0)
            gate.bias.fill_(0.5)
    return model


# fp32 modules vs the fp32 oracle: the largest error measured over this file, relative to
# max(1, max |expected|), is 2.1e-6 (hidden states, logits and hazards, every model and path).
# 6e-6 is ~3x that; 1e-5 allowed ~5x.
REL_TOL = 6e-6


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = max(1.0, float(expected.abs().max()))
    err = float((actual.float() - expected).abs().max())
    assert err <= REL_TOL * scale, f"max abs error {err:.3g} (scale {scale:.3g})"


def _meta(positions: list[int], loops: list[int], seqs: list[int]) -> ContiguousMetadata:
    return ContiguousMetadata(
        positions=torch.tensor(positions),
        loop_indices=torch.tensor(loops),
        seq_ids=torch.tensor(seqs),
    )


def _readout(model: LoopedCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """The state lm_head reads (the oracle's `hidden`)."""
    return hidden if model.config.norm_every_loop else model.model.norm(hidden)


def _check_rows(model, hidden, hazard, oracle: ReferenceOutput, loop: int, rows) -> None:
    _close(_readout(model, hidden), oracle.hidden[loop, rows])
    _close(model.coda(hidden), oracle.logits[loop, rows])
    if oracle.hazards is None:
        assert hazard is None
    else:
        _close(hazard, oracle.hazards[loop, rows])


def test_state_dict_uses_hugging_face_names():
    model = _build("ouro")
    names = set(model.state_dict())
    per_layer = {
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "input_layernorm_2.weight",
        "post_attention_layernorm.weight",
        "post_attention_layernorm_2.weight",
    }
    expected = {f"model.layers.{i}.{n}" for i in range(3) for n in per_layer} | {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.early_exit_gate.weight",
        "model.early_exit_gate.bias",
        "lm_head.weight",
    }
    assert names == expected


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("chunk", [None, 3])
@torch.inference_mode()
def test_full_depth_prefill_matches_oracle(name: str, chunk: int | None):
    """(a) Prefill (whole, or in chunks that each run every loop) equals the oracle at every
    depth: hidden read-out, hazards and logits."""
    model = _build(name)
    depth = model.num_loops
    ids = [5, 17, 3, 88, 42, 9, 9, 60]
    oracle = reference_forward(model.state_dict(), model.config, ids)
    cache = ContiguousKVCache(model.config, max_seqs=1, max_len=len(ids))
    step = chunk or len(ids)
    for start in range(0, len(ids), step):
        rows = list(range(start, min(start + step, len(ids))))
        hidden = model.prelude(torch.tensor([ids[r] for r in rows]))
        for loop in range(depth):
            out = model.recurrent(hidden, _meta(rows, [loop] * len(rows), [0] * len(rows)), cache)
            hidden = out.hidden
            _check_rows(model, hidden, out.hazard, oracle, loop, rows)


def _split(
    hazard: torch.Tensor | None, inverse: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if hazard is None:
        return None, None
    hazard = hazard[inverse]
    return hazard[:-1], hazard[-1:]


def _decode_alone(model, cache, seq: int, ids: list[int], exits: list[int]) -> None:
    """Run one sequence token by token, each token to its exit depth, LAST_EXITED copies."""
    for pos, (tok, e) in enumerate(zip(ids, exits, strict=True)):
        hidden = model.prelude(torch.tensor([tok]))
        for loop in range(e):
            hidden = model.recurrent(hidden, _meta([pos], [loop], [seq]), cache).hidden
        cache.copy_to_deeper(seq, pos, e - 1)


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.inference_mode()
def test_one_recurrent_call_mixes_loops_positions_and_sequences(name: str):
    """(b) Rows of two sequences at different loops and positions share each traversal."""
    model = _build(name)
    depth = model.num_loops
    ids0, exits0 = [7, 30, 12, 51, 4, 77], [depth, 1, depth - 1, 2, 1, depth]
    ids1 = [64, 8, 19, 93, 25]
    oracle0 = reference_forward(model.state_dict(), model.config, ids0, exits0)
    oracle1 = reference_forward(model.state_dict(), model.config, ids1)
    cache = ContiguousKVCache(model.config, max_seqs=2, max_len=8)

    # Seq 0: earlier tokens decoded one by one with mixed exits; its last token is at loop 1.
    _decode_alone(model, cache, 0, ids0[:-1], exits0[:-1])
    last = len(ids0) - 1
    h0 = model.prelude(torch.tensor(ids0[-1:]))
    h0 = model.recurrent(h0, _meta([last], [0], [0]), cache).hidden
    loop0 = 1
    # Seq 1: a whole prompt chunk, starting at loop 0, interleaved with seq 0's row.
    h1 = model.prelude(torch.tensor(ids1))
    loop1 = 0
    while loop1 < depth:
        if loop0 < depth:
            order = [1, 2, 0, 3, 4, 5]  # seq 0's row sits in the middle of seq 1's rows
            rows = torch.cat([h1, h0])[order]
            positions = [*range(len(ids1)), last]
            loops = [loop1] * len(ids1) + [loop0]
            seqs = [1] * len(ids1) + [0]
            meta = _meta(
                [positions[i] for i in order], [loops[i] for i in order], [seqs[i] for i in order]
            )
            out = model.recurrent(rows, meta, cache)
            inverse = torch.tensor(order).argsort()
            h1, h0 = out.hidden[inverse][:-1], out.hidden[inverse][-1:]
            hz1, hz0 = _split(out.hazard, inverse)
            _check_rows(model, h0, hz0, oracle0, loop0, [last])
            _check_rows(model, h1, hz1, oracle1, loop1, list(range(5)))
            loop0 += 1
        else:
            out = model.recurrent(h1, _meta(list(range(5)), [loop1] * 5, [1] * 5), cache)
            h1 = out.hidden
            _check_rows(model, h1, out.hazard, oracle1, loop1, list(range(5)))
        loop1 += 1


PROMPT = [1, 40, 7, 23, 66, 12]
NEW_TOKENS = 14


def _compare_greedy(model: LoopedCausalLM, controls: LoopControls | None) -> list[int]:
    got = greedy_decode(model, PROMPT, NEW_TOKENS, controls)
    kwargs = {}
    if controls is not None:
        kwargs = dict(
            min_loops=controls.min_loops,
            max_loops=controls.max_loops,
            exit_threshold=controls.exit_threshold,
        )
    want = reference_greedy(model.state_dict(), model.config, PROMPT, NEW_TOKENS, **kwargs)
    assert got == want
    return want[1]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_fixed_depth_matches_oracle(name: str):
    model = _build(name)
    assert _compare_greedy(model, None) == [model.num_loops] * NEW_TOKENS


@pytest.mark.parametrize("name", ["nanbeige", "nanbeige-skipnorm"])
def test_greedy_single_loop_matches_oracle(name: str):
    model = _build(name)
    depths = _compare_greedy(model, LoopControls(1, 1, 1.0))
    assert depths == [model.num_loops] + [1] * (NEW_TOKENS - 1)


@pytest.mark.parametrize("threshold", [0.3, 0.6, 0.9])
@pytest.mark.parametrize(("min_loops", "max_loops"), [(1, 4), (2, 4), (1, 3)])
def test_greedy_adaptive_exit_matches_oracle(threshold: float, min_loops: int, max_loops: int):
    """(c) Tokens and exit depths agree, and the exits really vary."""
    model = _build("ouro")
    depths = _compare_greedy(model, LoopControls(min_loops, max_loops, threshold))
    assert len(set(depths[1:])) >= 2, depths


def test_bf16_keeps_rope_inv_freq_fp32():
    """(d) Casting the model to bf16 must not round the RoPE frequencies."""
    model = _build("nanbeige")
    expected = model.model.rotary_emb.inv_freq.clone()
    model.to(torch.bfloat16)
    inv_freq = model.model.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.float32
    assert torch.equal(inv_freq, expected)
    assert model.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_rows_equal_the_computed_angles(dtype):
    """`precompute` keeps cos / sin of every position; gathered rows are the values `forward`
    computes, bit for bit, whatever the batch, and a cast of the module drops the table (its
    inv_freq is recomputed). A table that holds other angles (a shift, another dtype's rounding,
    a missing half) fails."""
    rope = _build("ouro").model.rotary_emb
    positions = [torch.tensor([0]), torch.tensor([511, 3, 3, 77]), torch.randint(0, 512, (13,))]
    computed = [rope(p, dtype) for p in positions]
    rope.precompute(512, dtype)
    assert rope.tables[dtype].shape == (512, 2, rope.head_dim)
    for p, (cos, sin) in zip(positions, computed, strict=True):
        got_cos, got_sin = rope(p, dtype)
        assert got_cos.dtype == dtype and got_cos.stride(-1) == 1
        assert torch.equal(got_cos, cos) and torch.equal(got_sin, sin)
    rope.to(torch.float64)
    assert rope.tables == {}


def test_fast_path_keeps_a_rope_table_over_the_context():
    model = _build("nanbeige")
    assert model.model.rotary_emb.tables == {}
    model.use_fast_path()
    context = model.config.max_position_embeddings
    assert model.model.rotary_emb.tables[torch.float32].shape == (context, 2, 16)


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.inference_mode()
def test_bf16_model_tracks_fp32_oracle(name: str):
    """bf16 weights, activations and KV stay near the fp32 oracle (loose: bf16 rounding)."""
    model = _build(name)
    ids = [5, 17, 3, 88, 42, 9, 9, 60]
    rows = list(range(len(ids)))
    oracle = reference_forward(model.state_dict(), model.config, ids)
    model.to(torch.bfloat16)
    cache = ContiguousKVCache(model.config, max_seqs=1, max_len=len(ids), dtype=torch.bfloat16)
    hidden = model.prelude(torch.tensor(ids))
    for loop in range(model.num_loops):
        out = model.recurrent(hidden, _meta(rows, [loop] * len(ids), [0] * len(ids)), cache)
        hidden = out.hidden
        assert hidden.dtype == torch.bfloat16
        expected = oracle.logits[loop]
        err = (model.coda(hidden).float() - expected).abs().max()
        assert err <= 0.05 * max(1.0, float(expected.abs().max()))
        if oracle.hazards is not None:
            assert out.hazard is not None and out.hazard.dtype == torch.float32
            assert (out.hazard - oracle.hazards[loop]).abs().max() <= 0.05
