import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlt_engine.checkpoints.loader import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    load_model,
    save_checkpoint,
)
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.models.configs import parse_config
from rlt_engine.models.layers import rope_inv_freq
from rlt_engine.models.registry import model_class
from rlt_engine.oracle.contiguous_kv import greedy_decode

PROMPT = [3, 17, 5, 42, 8]


def _raw(model_type: str) -> dict:
    raw = {
        "model_type": model_type,
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2 if model_type == "nanbeige" else 4,
        "head_dim": 8,
        "eos_token_id": 1,
        "bos_token_id": 0,
    }
    raw["num_loops" if model_type == "nanbeige" else "total_ut_steps"] = 3
    return raw


@pytest.fixture(params=["ouro", "nanbeige"])
def raw(request: pytest.FixtureRequest) -> dict:
    return _raw(request.param)


def _reference_state(raw: dict, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random fp32 weights (norms too, so a loader that skips them would be caught)."""
    model = model_class(raw["model_type"])(parse_config(raw))
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(t.shape, generator=gen) * 0.2 for name, t in model.state_dict().items()
    }


def _checkpoint(path: Path, raw: dict, state: dict[str, torch.Tensor], **save_kwargs: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    save_checkpoint(state, path, **save_kwargs)
    return path


def _decode(model: LoopedCausalLM) -> list[int]:
    return greedy_decode(model, PROMPT, 6)[0]


def _assert_state_equal(model: LoopedCausalLM, state: dict[str, torch.Tensor]) -> None:
    loaded = model.state_dict()
    assert loaded.keys() == state.keys()
    for name, t in state.items():
        assert loaded[name].dtype == t.dtype, name
        assert torch.equal(loaded[name], t), name


# --- round trips ---------------------------------------------------------------------------


def test_round_trip_single_file(tmp_path: Path, raw: dict) -> None:
    state = _reference_state(raw)
    ckpt = _checkpoint(tmp_path / "m", raw, state)
    assert (ckpt / SINGLE_FILE).is_file() and not (ckpt / INDEX_FILE).exists()
    model = load_model(ckpt, dtype=torch.float32)
    _assert_state_equal(model, state)

    reference = model_class(raw["model_type"])(parse_config(raw))
    reference.load_state_dict(state)
    assert _decode(model) == _decode(reference.eval())


def test_round_trip_sharded(tmp_path: Path, raw: dict) -> None:
    state = _reference_state(raw)
    ckpt = _checkpoint(tmp_path / "m", raw, state, max_shard_bytes=20_000)
    shards = sorted(ckpt.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (ckpt / SINGLE_FILE).exists()
    index = json.loads((ckpt / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(state)
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    sharded = load_model(ckpt, dtype=torch.float32)
    _assert_state_equal(sharded, state)

    single = load_model(_checkpoint(tmp_path / "s", raw, state), dtype=torch.float32)
    assert _decode(sharded) == _decode(single)


def test_save_replaces_previous_layout_and_handles_views(tmp_path: Path, raw: dict) -> None:
    state = _reference_state(raw)
    ckpt = _checkpoint(tmp_path / "m", raw, state, max_shard_bytes=20_000)
    # Non-contiguous views of a larger tensor must be saved as their own contiguous data.
    state = {n: t.t().contiguous().t() if t.dim() == 2 else t for n, t in state.items()}
    state["lm_head.weight"] = torch.randn(2, *state["lm_head.weight"].shape)[1]
    save_checkpoint(state, ckpt)
    assert not list(ckpt.glob("model-*")) and not (ckpt / INDEX_FILE).exists()
    _assert_state_equal(load_model(ckpt, dtype=torch.float32), state)


def test_returned_model_is_frozen_eval(tmp_path: Path, raw: dict) -> None:
    model = load_model(_checkpoint(tmp_path, raw, _reference_state(raw)), dtype=torch.float32)
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())


# --- dtypes ----------------------------------------------------------------------------------


def test_fp32_file_into_bf16_model(tmp_path: Path, raw: dict) -> None:
    state = _reference_state(raw)
    model = load_model(_checkpoint(tmp_path, raw, state), dtype=torch.bfloat16)
    _assert_state_equal(model, {n: t.bfloat16() for n, t in state.items()})


def test_bf16_file_into_fp32_model(tmp_path: Path, raw: dict) -> None:
    state = {n: t.bfloat16() for n, t in _reference_state(raw).items()}
    model = load_model(_checkpoint(tmp_path, raw, state), dtype=torch.float32)
    _assert_state_equal(model, {n: t.float() for n, t in state.items()})


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_inv_freq_stays_exact_fp32_in_bf16_model(
    tmp_path: Path, raw: dict, load_format: str
) -> None:
    model = load_model(
        _checkpoint(tmp_path, raw, _reference_state(raw)),
        dtype=torch.bfloat16,
        load_format=load_format,
    )
    inv_freq = model.model.rotary_emb.inv_freq
    cfg = model.config
    assert inv_freq.dtype == torch.float32 and inv_freq.device.type == "cpu"
    assert torch.equal(inv_freq, rope_inv_freq(cfg.head_dim, cfg.rope_theta))


def test_checkpoint_inv_freq_keys_are_ignored(tmp_path: Path, raw: dict) -> None:
    state = _reference_state(raw)
    extra = {"model.rotary_emb.inv_freq": torch.ones(4)}
    extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    model = load_model(_checkpoint(tmp_path, raw, {**state, **extra}), dtype=torch.float32)
    _assert_state_equal(model, state)
    cfg = model.config
    assert torch.equal(model.model.rotary_emb.inv_freq, rope_inv_freq(cfg.head_dim, 10000.0))


# --- rejections ------------------------------------------------------------------------------


def _rejects(path: Path, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as info:
        load_model(path, dtype=torch.float32)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_missing_tensor(tmp_path: Path, raw: dict) -> None:
    state = _reference_state(raw)
    del state["model.layers.1.mlp.up_proj.weight"]
    _rejects(_checkpoint(tmp_path, raw, state), "model.layers.1.mlp.up_proj.weight", "lacks 1")


def test_many_missing_tensors_are_counted(tmp_path: Path, raw: dict) -> None:
    state = _reference_state(raw)
    gone = [n for n in state if n.startswith("model.layers.1.")]
    for name in gone:
        del state[name]
    _rejects(_checkpoint(tmp_path, raw, state), gone[0], f"lacks {len(gone)}", "more)")


def test_unexpected_tensor(tmp_path: Path, raw: dict) -> None:
    state = {**_reference_state(raw), "model.layers.0.mlp.extra.weight": torch.ones(3)}
    _rejects(_checkpoint(tmp_path, raw, state), "model.layers.0.mlp.extra.weight", "unexpected")


def test_misshaped_tensor(tmp_path: Path, raw: dict) -> None:
    state = _reference_state(raw)
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(31, 32)
    _rejects(
        _checkpoint(tmp_path, raw, state),
        "model.layers.0.self_attn.q_proj.weight",
        "[32, 32]",
        "[31, 32]",
    )


def test_integer_tensor_where_weight_expected(tmp_path: Path, raw: dict) -> None:
    state = _reference_state(raw)
    state["model.norm.weight"] = torch.ones(32, dtype=torch.int64)
    _rejects(_checkpoint(tmp_path, raw, state), "model.norm.weight", "I64")


def test_missing_shard(tmp_path: Path, raw: dict) -> None:
    ckpt = _checkpoint(tmp_path, raw, _reference_state(raw), max_shard_bytes=20_000)
    shard = sorted(ckpt.glob("model-*-of-*.safetensors"))[1]
    shard.unlink()
    _rejects(ckpt, shard.name, "missing")


def test_index_points_to_wrong_shard(tmp_path: Path, raw: dict) -> None:
    ckpt = _checkpoint(tmp_path, raw, _reference_state(raw), max_shard_bytes=20_000)
    index = json.loads((ckpt / INDEX_FILE).read_text())
    name = "lm_head.weight"
    wrong = next(
        s for s in sorted(set(index["weight_map"].values())) if s != index["weight_map"][name]
    )
    index["weight_map"][name] = wrong
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    _rejects(ckpt, name, wrong)


def test_tensor_missing_from_index(tmp_path: Path, raw: dict) -> None:
    ckpt = _checkpoint(tmp_path, raw, _reference_state(raw), max_shard_bytes=20_000)
    index = json.loads((ckpt / INDEX_FILE).read_text())
    del index["weight_map"]["model.norm.weight"]
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    _rejects(ckpt, "model.norm.weight", INDEX_FILE)


def test_tensor_in_two_shards(tmp_path: Path, raw: dict) -> None:
    ckpt = _checkpoint(tmp_path, raw, _reference_state(raw), max_shard_bytes=20_000)
    shard = sorted(ckpt.glob("model-*-of-*.safetensors"))[0]
    save_file({"model.norm.weight": torch.ones(32)}, shard)  # clobbers shard 1 with a duplicate
    _rejects(ckpt, "model.norm.weight")


def test_no_weights_file(tmp_path: Path, raw: dict) -> None:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    _rejects(tmp_path, str(tmp_path), "rlt download", "dummy")


def test_bad_load_format(tmp_path: Path, raw: dict) -> None:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="auto, safetensors, dummy") as info:
        load_model(tmp_path, load_format="pt")
    assert not isinstance(info.value, CheckpointError)


# --- dummy weights ---------------------------------------------------------------------------


def _dummy(path: Path, raw: dict, seed: int, dtype: torch.dtype = torch.float32) -> LoopedCausalLM:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    return load_model(path, dtype=dtype, load_format="dummy", seed=seed)


def test_dummy_needs_only_config_and_has_real_shapes(tmp_path: Path, raw: dict) -> None:
    model = _dummy(tmp_path, raw, seed=0, dtype=torch.bfloat16)
    expected = model_class(raw["model_type"])(parse_config(raw)).state_dict()
    state = model.state_dict()
    assert {n: t.shape for n, t in state.items()} == {n: t.shape for n, t in expected.items()}
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in state.values())
    for name, t in state.items():
        if "norm" in name:
            assert torch.equal(t, torch.ones_like(t)), name
        elif name.endswith("bias"):
            assert torch.equal(t, torch.zeros_like(t)), name
        else:
            assert 0.01 < float(t.float().std()) < 0.04, name
    assert ("model.early_exit_gate.bias" in state) == (raw["model_type"] == "ouro")
    assert len(_decode(model)) == 6


def test_dummy_is_deterministic_per_seed(tmp_path: Path, raw: dict) -> None:
    a = _dummy(tmp_path / "a", raw, seed=3).state_dict()
    b = _dummy(tmp_path / "b", raw, seed=3).state_dict()
    c = _dummy(tmp_path / "c", raw, seed=4).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_building_the_model_imports_no_compiler() -> None:
    """Issue 10 item 3: meta-device construction sent every op through torch's Python reference
    ops, whose first use imports torch._dynamo and sympy (about 2.5 s of start-up)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys, torch\n"
        "from rlt_engine.checkpoints.loader import load_model\n"
        "m = load_model('rlt_engine/assets/ouro-gsm8k-tiny', dtype=torch.bfloat16)\n"
        "assert m.model.rotary_emb.inv_freq.dtype == torch.float32\n"
        "assert next(m.parameters()).dtype == torch.bfloat16\n"
        "print(sorted(n for n in ('torch._dynamo', 'sympy') if n in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
