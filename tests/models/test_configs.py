import json
from pathlib import Path

import pytest

from rlt_engine.checkpoints.aliases import ALIASES, resolve_model_name
from rlt_engine.checkpoints.resolve import KNOWN_CONFIGS
from rlt_engine.models.configs import ConfigError, load_config, parse_config

# The published config.json files, copied verbatim (see tests/fixtures/README.md).
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REAL_OURO = FIXTURES / "ouro-1.4b" / "config.json"
REAL_NANBEIGE = FIXTURES / "nanbeige4.2-3b" / "config.json"


def _ouro_raw() -> dict:
    return json.loads(REAL_OURO.read_text())


def _nanbeige_raw() -> dict:
    return json.loads(REAL_NANBEIGE.read_text())


def test_the_packaged_ouro_config_is_the_published_one():
    assert json.loads((KNOWN_CONFIGS / "ouro-1.4b" / "config.json").read_text()) == _ouro_raw()


def test_real_ouro_config_parses_to_design_facts():
    cfg = load_config(REAL_OURO.parent)
    assert cfg.model_type == "ouro"
    assert (cfg.hidden_size, cfg.intermediate_size) == (2048, 5632)
    assert (cfg.num_layers, cfg.num_loops, cfg.vocab_size) == (24, 4, 49152)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (16, 16, 128)
    assert cfg.has_exit_gate and cfg.sandwich_norm and cfg.early_exit_threshold == 1.0
    assert (cfg.rope_theta, cfg.rms_norm_eps) == (1e6, 1e-6)
    assert cfg.norm_every_loop and cfg.max_position_embeddings == 65536
    # bos = eos = 0 (<|endoftext|>); <|im_end|> = 2 is added from the tokenizer, not the config
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (0, (0,))
    # docs/kv-cache.md: 3 MiB per 16-token block and 192 KiB per token per plane in bf16.
    assert cfg.kv_bytes_per_token(2) == 192 * 1024
    assert cfg.kv_slots == 96


def test_real_nanbeige_config_parses_to_design_facts():
    cfg = load_config(REAL_NANBEIGE.parent)
    assert cfg.model_type == "nanbeige"
    assert (cfg.hidden_size, cfg.intermediate_size) == (3072, 10752)
    assert (cfg.num_layers, cfg.num_loops, cfg.vocab_size) == (22, 2, 166144)
    assert (cfg.num_heads, cfg.num_kv_heads) == (48, 8)
    assert (cfg.rope_theta, cfg.rms_norm_eps) == (7e7, 1e-5)
    assert not cfg.has_exit_gate and not cfg.sandwich_norm and cfg.norm_every_loop
    # bos <|im_start|> 166100, eos <|im_end|> 166101; the third stop token (166102, <|endoftext|>)
    # comes from the tokenizer (tests/models/test_tokenizer.py), not from config.json
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (166100, (166101,))
    assert cfg.kv_slots == 44  # one per (loop, layer)
    # K and V of 22 layers x 8 KV heads x 128 dims in bf16, per token and plane
    assert cfg.kv_bytes_per_token(2) == 2 * 22 * 8 * 128 * 2
    raw = _nanbeige_raw()
    assert raw["tie_word_embeddings"] is False and raw["torch_dtype"] == "bfloat16"
    assert raw["kv_channels"] == raw["head_dim"] == cfg.head_dim


def test_nanbeige_head_dim_comes_from_config_not_hidden_over_heads():
    cfg = parse_config(_nanbeige_raw())
    assert cfg.head_dim == 128 and cfg.hidden_size // cfg.num_heads == 64
    assert not parse_config({**_nanbeige_raw(), "skip_loop_final_norm": True}).norm_every_loop


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rope_scaling", {"type": "yarn", "factor": 4.0}),
        ("use_sliding_window", True),
        ("tie_word_embeddings", True),
        ("hidden_act", "gelu"),
        ("attention_bias", True),
        ("layer_types", ["sliding_attention"] * 24),
    ],
)
def test_ouro_unsupported_features_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        parse_config({**_ouro_raw(), field: value})


@pytest.mark.parametrize(
    "field",
    [
        "enable_hyper_connection",
        "enable_mhc",
        "insert_ngram_layer_idx",
        "emb_neighbor_num",
        "loop_share_kv",
        "enable_depth_attention",
        "qk_layernorm",
        "mlp_bias",
    ],
)
def test_nanbeige_unsupported_options_name_the_field(field):
    with pytest.raises(ConfigError, match=field):
        parse_config({**_nanbeige_raw(), field: True if field != "emb_neighbor_num" else 4})


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"model_type": "llama"}, "not supported"),
        ({"num_attention_heads": 5}, "multiple"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"total_ut_steps": None}, "total_ut_steps"),
        ({"eos_token_id": None}, "eos_token_id"),
        ({"early_exit_threshold": 1.5}, "early_exit_threshold"),
        ({"bos_token_id": 10**6}, "outside the vocabulary"),
    ],
)
def test_invalid_values_are_rejected(patch, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({**_ouro_raw(), **patch})


def test_load_config_errors_are_readable(tmp_path):
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_aliases_are_pinned():
    assert resolve_model_name("ouro") == (
        "ByteDance/Ouro-1.4B",
        "574fa66cb8bf5abdc979642d01cf2b79b16bfab1",
    )
    assert resolve_model_name("nanbeige")[1] == "b82e54bd609793562a75cbf9337970a93369eab5"
    assert set(ALIASES) >= {"ouro", "ouro-2.6b", "ouro-thinking", "ouro-2.6b-thinking", "nanbeige"}
    # the pin also applies to the plain repo id; unknown repos get no pin
    assert resolve_model_name("ByteDance/Ouro-2.6B")[1] == ALIASES["ouro-2.6b"].revision
    assert resolve_model_name("someone/other") == ("someone/other", None)
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model_name("not-a-model")
