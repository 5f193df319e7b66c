"""The tiny checkpoints used across the suite: HF layout, configs and weights that match."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tiny_checkpoints import write_tiny_nanbeige, write_tiny_ouro

from rlt_engine.models.configs import load_config
from rlt_engine.models.registry import model_class


def _module_state(model_dir: Path) -> dict[str, torch.Tensor]:
    config = load_config(model_dir)
    return model_class(config.model_type)(config).state_dict()


@pytest.mark.parametrize("fixture", ["tiny_ouro_dir", "tiny_nanbeige_dir"])
def test_safetensors_match_the_module(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    weights = load_file(model_dir / "model.safetensors")
    expected = _module_state(model_dir)
    assert set(weights) == set(expected)
    for name, tensor in weights.items():
        assert tensor.shape == expected[name].shape, name
        assert tensor.dtype == torch.float32, name


def test_tiny_ouro_config(tiny_ouro_dir: Path, ouro_real_dir: Path) -> None:
    raw = json.loads((tiny_ouro_dir / "config.json").read_text())
    real = json.loads((ouro_real_dir / "config.json").read_text())
    assert set(raw) == set(real)
    config = load_config(tiny_ouro_dir)
    assert (config.model_type, config.num_loops, config.num_layers) == ("ouro", 4, 2)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.has_exit_gate and config.sandwich_norm and config.vocab_size == 49152
    assert (config.bos_token_id, config.eos_token_ids) == (0, (0,))


def test_tiny_nanbeige_config(tiny_nanbeige_dir: Path) -> None:
    config = load_config(tiny_nanbeige_dir)
    assert (config.model_type, config.num_loops, config.has_exit_gate) == ("nanbeige", 2, False)
    assert config.head_dim == 16 != config.hidden_size // config.num_heads
    assert config.num_kv_heads == 2 and config.kv_slots == 4


def test_weights_are_deterministic_and_seeded(tmp_path: Path) -> None:
    a = load_file(write_tiny_nanbeige(tmp_path / "a") / "model.safetensors")
    b = load_file(write_tiny_nanbeige(tmp_path / "b") / "model.safetensors")
    c = load_file(write_tiny_nanbeige(tmp_path / "c", seed=1) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()


def test_weights_are_not_trivial(tiny_ouro_dir: Path) -> None:
    w = load_file(tiny_ouro_dir / "model.safetensors")
    norm = w["model.layers.0.input_layernorm.weight"]
    assert not torch.allclose(norm, torch.ones_like(norm))
    assert not torch.equal(w["model.layers.0.input_layernorm.weight"], w["model.norm.weight"])
    gate_w, gate_b = w["model.early_exit_gate.weight"], w["model.early_exit_gate.bias"]
    assert gate_w.shape == (1, 64) and gate_b.shape == (1,)
    hazards = torch.sigmoid(
        torch.randn(256, 64, generator=torch.Generator().manual_seed(0)) @ gate_w.T + gate_b
    )
    assert hazards.std() > 0.05  # the gate separates states


def test_config_overrides(tmp_path: Path) -> None:
    out = write_tiny_ouro(tmp_path, tokenizer_from=None, num_hidden_layers=3, total_ut_steps=2)
    config = load_config(out)
    assert (config.num_layers, config.num_loops) == (3, 2)
    raw = json.loads((out / "config.json").read_text())
    assert len(raw["layer_types"]) == 3
    assert not (out / "tokenizer.json").exists()
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "model.layers.2.mlp.down_proj.weight" in set(f.keys())
