"""The dense oracle on its own: exit rule, LAST_EXITED locality, greedy consistency, and an
independent check against transformers' Llama (Nanbeige without inter-loop norm is a Llama
whose layer stack is repeated)."""

from __future__ import annotations

import random

import pytest
import torch

from rlt_engine.core.exit_rule import ExitTracker, LoopControls
from rlt_engine.models.configs import LoopedLMConfig, parse_config
from rlt_engine.oracle.reference import (
    reference_exit_depth,
    reference_forward,
    reference_greedy,
)

VOCAB = 64


def _raw(model_type: str, loops: int, **extra: object) -> dict:
    raw: dict = {
        "model_type": model_type,
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,  # not hidden/heads (8), as in Nanbeige
        "rope_theta": 5000.0,
        "eos_token_id": 1,
        "bos_token_id": 0,
        **extra,
    }
    raw["total_ut_steps" if model_type == "ouro" else "num_loops"] = loops
    return raw


def _state_dict(cfg: LoopedLMConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names, built by hand (no model modules involved)."""
    g = torch.Generator().manual_seed(seed)
    h, i, qd, kvd = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    )

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm_weight() -> torch.Tensor:
        return 1 + rand(h, scale=0.1)

    sd = {
        "model.embed_tokens.weight": rand(cfg.vocab_size, h, scale=1.0),
        "model.norm.weight": norm_weight(),
        "lm_head.weight": rand(cfg.vocab_size, h),
    }
    norms = ["input_layernorm", "post_attention_layernorm"]
    if cfg.sandwich_norm:
        norms += ["input_layernorm_2", "post_attention_layernorm_2"]
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        sd[p + "self_attn.q_proj.weight"] = rand(qd, h)
        sd[p + "self_attn.k_proj.weight"] = rand(kvd, h)
        sd[p + "self_attn.v_proj.weight"] = rand(kvd, h)
        sd[p + "self_attn.o_proj.weight"] = rand(h, qd)
        sd[p + "mlp.gate_proj.weight"] = rand(i, h)
        sd[p + "mlp.up_proj.weight"] = rand(i, h)
        sd[p + "mlp.down_proj.weight"] = rand(h, i)
        for name in norms:
            sd[p + name + ".weight"] = norm_weight()
    if cfg.has_exit_gate:
        sd["model.early_exit_gate.weight"] = rand(1, h, scale=0.5)
        sd["model.early_exit_gate.bias"] = rand(1, scale=1.0) - 0.5
    return sd


# ---------------------------------------------------------------- exit rule


def _tracker_depth(hazards: list[float] | None, controls: LoopControls) -> int:
    tracker = ExitTracker(controls)
    for t in range(controls.max_loops):
        if tracker.step(None if hazards is None else hazards[t]):
            break
    return tracker.loops_done


def _near_threshold_hazards(rng: random.Random, threshold: float, depth: int) -> list[float]:
    """Hazards whose CDF lands within a few float32 ulps of the threshold at some loop."""
    hit = rng.randrange(depth)
    hazards = [rng.uniform(0.0, threshold / depth) for _ in range(depth)]
    remaining = 1.0
    for lam in hazards[:hit]:
        remaining *= 1.0 - lam
    exact = 1.0 - (1.0 - threshold) / remaining  # makes CDF_hit == threshold in real numbers
    lam = torch.tensor(min(max(exact, 0.0), 1.0), dtype=torch.float32)
    for _ in range(rng.randrange(-3, 4)):
        lam = torch.nextafter(lam, torch.tensor(2.0 if rng.random() < 0.5 else -1.0))
    hazards[hit] = float(lam.clamp(0.0, 1.0))
    return hazards


def test_exit_rule_agrees_with_core_tracker():
    rng = random.Random(1234)
    for case in range(4000):
        depth = rng.randint(1, 6)
        max_loops = rng.randint(1, depth)
        min_loops = rng.randint(1, max_loops)
        threshold = rng.choice([0.0, 0.3, 0.5, 0.6, 0.9, 0.999, 1.0, rng.random()])
        if case % 3 == 0:
            hazards = _near_threshold_hazards(rng, threshold, depth)
        else:
            hazards = [float(torch.rand(1, dtype=torch.float32)) for _ in range(depth)]
        controls = LoopControls(min_loops, max_loops, threshold)
        got = reference_exit_depth(
            torch.tensor(hazards, dtype=torch.float32),
            min_loops=min_loops,
            max_loops=max_loops,
            exit_threshold=threshold,
        )
        assert got == _tracker_depth(hazards, controls), (hazards, controls)


def test_exit_rule_edge_cases():
    certain = torch.ones(4)
    kwargs = {"min_loops": 1, "max_loops": 4}
    assert reference_exit_depth(certain, exit_threshold=1.0, **kwargs) == 4
    assert reference_exit_depth(torch.zeros(4), exit_threshold=0.0, **kwargs) == 1
    assert reference_exit_depth(None, exit_threshold=0.1, **kwargs) == 4
    assert reference_exit_depth(certain, min_loops=3, max_loops=4, exit_threshold=0.5) == 3
    assert reference_exit_depth(torch.zeros(4), min_loops=1, max_loops=2, exit_threshold=0.5) == 2


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("model_type", ["ouro", "nanbeige"])
def test_forward_shapes_and_default_depths(model_type: str):
    cfg = parse_config(_raw(model_type, loops=3))
    sd = _state_dict(cfg)
    ids = [5, 9, 2, 33, 7]
    out = reference_forward(sd, cfg, ids)
    assert out.hidden.shape == (3, 5, cfg.hidden_size)
    assert out.logits.shape == (3, 5, VOCAB) and out.logits.dtype == torch.float32
    if cfg.has_exit_gate:
        assert out.hazards is not None and out.hazards.shape == (3, 5)
        assert out.hazards.dtype == torch.float32
    else:
        assert out.hazards is None
    explicit = reference_forward(sd, cfg, torch.tensor(ids), [3] * 5)
    assert torch.equal(explicit.logits, out.logits)
    # Loops differ: the read-out really moves from loop to loop.
    assert not torch.allclose(out.logits[0], out.logits[-1])


def test_forward_casts_to_fp32():
    cfg = parse_config(_raw("ouro", loops=2))
    sd = _state_dict(cfg)
    half = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    exact = reference_forward({k: v.float() for k, v in half.items()}, cfg, [3, 4, 5])
    out = reference_forward(half, cfg, [3, 4, 5])
    assert out.logits.dtype == torch.float32
    assert torch.equal(out.logits, exact.logits)


def test_exit_depths_are_validated():
    cfg = parse_config(_raw("ouro", loops=3))
    sd = _state_dict(cfg)
    message = r"exit_depths must hold 2 values in 1\.\.3"
    with pytest.raises(ValueError, match=message):
        reference_forward(sd, cfg, [1, 2], [1, 4])
    with pytest.raises(ValueError, match=message):
        reference_forward(sd, cfg, [1, 2], [0, 3])
    with pytest.raises(ValueError, match=message):
        reference_forward(sd, cfg, [1, 2], [3])


def test_exit_depths_change_only_later_tokens_at_deeper_loops():
    """Token i at loop d can only be affected if some j <= i exited at depth <= d."""
    cfg = parse_config(_raw("ouro", loops=4))
    sd = _state_dict(cfg)
    ids = [4, 8, 15, 16, 23, 42, 7]
    exits = [4, 2, 4, 1, 3, 4, 4]
    full = reference_forward(sd, cfg, ids)
    mixed = reference_forward(sd, cfg, ids, exits)
    assert mixed.hazards is not None and full.hazards is not None
    first_exit = torch.tensor(exits).cummin(0).values  # min over j <= i
    for d in range(4):
        for i in range(len(ids)):
            same = torch.equal(mixed.logits[d, i], full.logits[d, i])
            if d < first_exit[i]:
                assert same and torch.equal(mixed.hazards[d, i], full.hazards[d, i]), (d, i)
            elif i > 0 and exits[i - 1] <= d:
                # The previous token's frozen K/V is visible: outputs must move.
                assert not same, (d, i)


def test_exit_at_depth_d_equals_depth_d_kv_copied():
    """Exiting at D-1 differs from D only in what later tokens read at the last loop."""
    cfg = parse_config(_raw("ouro", loops=3))
    sd = _state_dict(cfg)
    ids = [3, 1, 4, 1, 5]
    a = reference_forward(sd, cfg, ids, [3, 2, 3, 3, 3])
    b = reference_forward(sd, cfg, ids)
    assert torch.equal(a.logits[:2], b.logits[:2])
    assert torch.equal(a.logits[2, 0], b.logits[2, 0])
    # Token 1's own loop-2 output is moot (it exited); tokens after it read its loop-1 K/V.
    assert not torch.allclose(a.logits[2, 2:], b.logits[2, 2:])


# ---------------------------------------------------------------- against transformers


def _llama_logits(sd: dict, cfg: LoopedLMConfig, ids: list[int], repeats: int) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    n = cfg.num_layers
    llama_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=n * repeats,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(llama_cfg).eval()
    weights = {}
    for name, tensor in sd.items():
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            for r in range(repeats):  # the loop is the same stack run again
                weights[f"model.layers.{int(layer) + r * n}.{rest}"] = tensor
        else:
            weights[name] = tensor
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("loops", [1, 2, 3])
def test_nanbeige_without_loop_norm_is_a_repeated_llama(loops: int):
    cfg = parse_config(_raw("nanbeige", loops=loops, skip_loop_final_norm=True))
    sd = _state_dict(cfg, seed=7)
    ids = [11, 2, 40, 7, 7, 63, 0, 19]
    out = reference_forward(sd, cfg, ids)
    for d in range(loops):
        expected = _llama_logits(sd, cfg, ids, repeats=d + 1)
        # measured: at most 3.0e-6 apart (logits up to |3.7|, 1..3 loops); 1e-5 is ~3x that
        # (rtol=atol=1e-5 allowed up to 4.7e-5, ~15x)
        torch.testing.assert_close(out.logits[d], expected, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- greedy


def _teacher_forced_check(
    sd: dict,
    cfg: LoopedLMConfig,
    prompt: list[int],
    tokens: list[int],
    depths: list[int],
    controls: LoopControls,
) -> None:
    """One forward over the finished sequence reproduces every greedy choice and exit depth."""
    p = len(prompt)
    seq = prompt + tokens[:-1]
    out = reference_forward(sd, cfg, seq, [cfg.num_loops] * p + depths[1:])
    for i, (tok, e) in enumerate(zip(tokens, depths, strict=True)):
        row = p - 1 + i
        assert int(out.logits[e - 1, row].argmax()) == tok
        if i > 0:
            hazards = None if out.hazards is None else out.hazards[:, row]
            rule = reference_exit_depth(
                hazards,
                min_loops=controls.min_loops,
                max_loops=controls.max_loops,
                exit_threshold=controls.exit_threshold,
            )
            assert rule == e


@pytest.mark.parametrize(
    ("model_type", "controls"),
    [
        ("ouro", LoopControls(1, 4, 1.0)),
        ("ouro", LoopControls(1, 4, 0.5)),
        ("ouro", LoopControls(2, 3, 0.7)),
        ("nanbeige", LoopControls(1, 4, 1.0)),
        ("nanbeige", LoopControls(1, 1, 1.0)),
    ],
)
def test_greedy_is_consistent_with_one_forward(model_type: str, controls: LoopControls):
    cfg = parse_config(_raw(model_type, loops=4))
    sd = _state_dict(cfg, seed=3)
    prompt = [2, 17, 5, 40]
    tokens, depths = reference_greedy(
        sd,
        cfg,
        prompt,
        10,
        min_loops=controls.min_loops,
        max_loops=controls.max_loops,
        exit_threshold=controls.exit_threshold,
    )
    assert len(tokens) == len(depths) == 10
    assert depths[0] == 4
    assert all(controls.min_loops <= e <= controls.max_loops for e in depths[1:])
    _teacher_forced_check(sd, cfg, prompt, tokens, depths, controls)


def test_greedy_edge_lengths():
    cfg = parse_config(_raw("ouro", loops=2))
    sd = _state_dict(cfg)
    assert reference_greedy(sd, cfg, [1, 2], 0) == ([], [])
    tokens, depths = reference_greedy(sd, cfg, torch.tensor([1, 2]), 1)
    assert len(tokens) == 1 and depths == [2]
