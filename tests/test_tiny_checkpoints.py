"""The tiny checkpoints used across the suite: HF layout, configs and weights that match."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tiny_checkpoints import tiny_nanbeige_config, write_tiny_nanbeige, write_tiny_ouro

from rlt_engine.models.configs import load_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"
OURO_OFFICIAL = FIXTURES / "ouro-tiny-official"  # written by the official Ouro code
OURO_1_4B_CONFIG = FIXTURES / "ouro-1.4b" / "config.json"
OURO_1_4B_TENSORS = 269  # the published model.safetensors of Ouro-1.4B
OURO_1_4B_BYTES = 2_869_336_434


def hf_layout(raw: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a checkpoint in Hugging Face layout, from config.json alone.

    Written from the published checkpoints, not from our modules: Llama-style projections and
    SwiGLU MLP without biases, Ouro's four sandwich norms per layer and its exit gate, Nanbeige's
    two pre-norms, untied lm_head, no rotary buffer.
    """
    hidden, inter, vocab = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    head_dim = raw.get("head_dim") or hidden // heads
    ouro = raw["model_type"] == "ouro"
    norms = ("input_layernorm", "post_attention_layernorm")
    if ouro:
        norms += ("input_layernorm_2", "post_attention_layernorm_2")
    layout = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layout[p + "self_attn.q_proj.weight"] = (heads * head_dim, hidden)
        layout[p + "self_attn.k_proj.weight"] = (kv_heads * head_dim, hidden)
        layout[p + "self_attn.v_proj.weight"] = (kv_heads * head_dim, hidden)
        layout[p + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        layout[p + "mlp.gate_proj.weight"] = (inter, hidden)
        layout[p + "mlp.up_proj.weight"] = (inter, hidden)
        layout[p + "mlp.down_proj.weight"] = (hidden, inter)
        layout.update({f"{p}{norm}.weight": (hidden,) for norm in norms})
    layout["model.norm.weight"] = (hidden,)
    if ouro:
        layout["model.early_exit_gate.weight"] = (1, hidden)
        layout["model.early_exit_gate.bias"] = (1,)
    layout["lm_head.weight"] = (vocab, hidden)
    return layout


def _file_layout(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(path, "pt") as f:
        names = list(f.keys())  # a safetensors handle, not a dict
        return {name: tuple(f.get_slice(name).get_shape()) for name in names}


def test_the_layout_spec_is_what_the_official_ouro_code_writes() -> None:
    raw = json.loads((OURO_OFFICIAL / "config.json").read_text())
    assert hf_layout(raw) == _file_layout(OURO_OFFICIAL / "model.safetensors")


def test_the_layout_spec_accounts_for_the_published_ouro_1_4b_file() -> None:
    layout = hf_layout(json.loads(OURO_1_4B_CONFIG.read_text()))
    assert len(layout) == OURO_1_4B_TENSORS
    weight_bytes = 2 * sum(math.prod(shape) for shape in layout.values())  # bf16
    header = OURO_1_4B_BYTES - weight_bytes  # 8-byte length + JSON header of 269 entries
    assert 8 < header < 64 * 1024, header


def test_the_nanbeige_layout_spec_is_a_llama_layout() -> None:
    """Nanbeige's layers are Llama's: transformers' Llama has the same tensors."""
    transformers = pytest.importorskip("transformers")
    raw = tiny_nanbeige_config(vocab_size=512, bos=509, eos=510)
    llama = transformers.LlamaConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"],
        head_dim=raw["head_dim"],
        tie_word_embeddings=False,
    )
    state = transformers.LlamaForCausalLM(llama).state_dict()
    assert hf_layout(raw) == {k: tuple(v.shape) for k, v in state.items() if "rotary" not in k}


@pytest.mark.parametrize("fixture", ["tiny_ouro_dir", "tiny_nanbeige_dir"])
def test_safetensors_are_in_hf_layout(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    raw = json.loads((model_dir / "config.json").read_text())
    assert _file_layout(model_dir / "model.safetensors") == hf_layout(raw)
    weights = load_file(model_dir / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}


def test_tiny_ouro_config(tiny_ouro_dir: Path) -> None:
    raw = json.loads((tiny_ouro_dir / "config.json").read_text())
    real = json.loads(OURO_1_4B_CONFIG.read_text())
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
