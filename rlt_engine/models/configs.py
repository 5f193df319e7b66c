"""Typed, validated architecture configs parsed from Hugging Face `config.json` files.

Only what our model code implements is accepted: any option that would change the function
of the network (rope scaling, sliding windows, Nanbeige's n-gram or hyper-connection branches,
biases the checkpoint may carry) is refused with an error that names the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("ouro", "nanbeige")


class CheckpointError(ValueError):
    """A checkpoint directory the engine cannot use: a config.json or weights file that is
    missing, unreadable or does not match the model. The message is one line naming the file
    (and the field or tensor). Defined here, torch-free; `rlt_engine.checkpoints.loader`
    re-exports it.
    """


class ConfigError(CheckpointError):
    """A config.json that we cannot run faithfully."""


@dataclass(frozen=True)
class LoopedLMConfig:
    """Architecture of a looped decoder: `num_layers` shared layers traversed `num_loops` times."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_loops: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Ouro: sandwich norms and a learned exit gate. Nanbeige: plain pre-norm, no gate.
    sandwich_norm: bool
    has_exit_gate: bool
    early_exit_threshold: float = 1.0
    # False only for Nanbeige's `skip_loop_final_norm`: then model.norm runs once, in the coda.
    norm_every_loop: bool = True

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {self.model_type!r} is not supported")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_loops",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ConfigError("rope_theta and rms_norm_eps must be positive")
        if not 0.0 <= self.early_exit_threshold <= 1.0:
            raise ConfigError(
                f"early_exit_threshold must lie in [0, 1], got {self.early_exit_threshold}"
            )
        if not self.eos_token_ids:
            raise ConfigError("eos_token_id is missing")
        for tok in (*self.eos_token_ids, self.bos_token_id):
            if tok is not None and not 0 <= tok < self.vocab_size:
                raise ConfigError(f"special token id {tok} is outside the vocabulary")

    @property
    def kv_slots(self) -> int:
        """KV slots per token position: one per (loop, layer)."""
        return self.num_loops * self.num_layers

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token on one loop plane."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def load_config(model_dir: str | Path) -> LoopedLMConfig:
    """The config of a checkpoint directory; every problem is a ConfigError naming the file."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {model_dir}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {_one_line(exc)}") from None
    try:
        return parse_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def parse_config(raw: dict[str, Any]) -> LoopedLMConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json must hold a JSON object, not a {_json_type(raw)}")
    model_type = raw.get("model_type")
    if model_type == "ouro":
        return _parse_ouro(raw)
    if model_type == "nanbeige":
        return _parse_nanbeige(raw)
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    raise ConfigError(f"model_type {model_type!r} is not supported (supported: {supported})")


def _require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw or raw[key] is None:
        raise ConfigError(f"config.json lacks required field {key!r}")
    return raw[key]


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _int(raw: dict[str, Any], key: str, default: Any = None) -> int:
    """Field `key` as an int (required when `default` is None); a float with an integral value
    is accepted, anything else is a ConfigError naming the field."""
    value = _require(raw, key) if default is None else raw.get(key)
    if value is None:
        value = default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"field {key!r} must be an integer, got {value!r}")
    return value


def _float(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"field {key!r} must be a number, got {value!r}")
    return float(value)


def _token_id(value: Any, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"field {key!r} must be an integer token id, got {value!r}")
    return value


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    items = eos if isinstance(eos, list) else [eos]
    return tuple(_token_id(t, "eos_token_id") for t in items)


def _one_line(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _refuse_common(raw: dict[str, Any]) -> None:
    if raw.get("rope_scaling"):
        raise ConfigError("rope_scaling is not supported (field 'rope_scaling')")
    if raw.get("use_sliding_window") or (
        raw.get("sliding_window") and raw.get("use_sliding_window") is not False
    ):
        raise ConfigError("sliding-window attention is not supported (field 'use_sliding_window')")
    layer_types = raw.get("layer_types") or []
    if not isinstance(layer_types, list):
        raise ConfigError(f"field 'layer_types' must be a list, got {layer_types!r}")
    if any(t != "full_attention" for t in layer_types):
        raise ConfigError("only full-attention layers are supported (field 'layer_types')")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (field 'hidden_act')")
    if raw.get("tie_word_embeddings"):
        raise ConfigError("tied embeddings are not supported (field 'tie_word_embeddings')")
    for flag in ("attention_bias", "mlp_bias", "qk_layernorm"):
        if raw.get(flag):
            raise ConfigError(f"{flag} is not supported (field {flag!r})")


def _common_fields(raw: dict[str, Any]) -> dict[str, Any]:
    hidden = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    if heads <= 0:
        raise ConfigError(f"field 'num_attention_heads' must be positive, got {heads}")
    bos = raw.get("bos_token_id")
    return dict(
        vocab_size=_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size"),
        num_layers=_int(raw, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=_int(raw, "num_key_value_heads", heads) or heads,
        # Nanbeige's head_dim (128) is not hidden/heads (64): always prefer the explicit field.
        head_dim=_int(raw, "head_dim", hidden // heads) or hidden // heads,
        rope_theta=_float(raw, "rope_theta", 10000.0),
        rms_norm_eps=_float(raw, "rms_norm_eps", 1e-6),
        max_position_embeddings=_int(raw, "max_position_embeddings", 4096),
        bos_token_id=None if bos is None else _token_id(bos, "bos_token_id"),
        eos_token_ids=_eos_ids(raw),
    )


def _parse_ouro(raw: dict[str, Any]) -> LoopedLMConfig:
    _refuse_common(raw)
    return LoopedLMConfig(
        model_type="ouro",
        num_loops=_int(raw, "total_ut_steps"),
        sandwich_norm=True,
        has_exit_gate=True,
        early_exit_threshold=_float(raw, "early_exit_threshold", 1.0),
        **_common_fields(raw),
    )


# Options of the Nanbeige config class that add branches or weights our model does not have.
_NANBEIGE_UNSUPPORTED = (
    "emb_neighbor_num",
    "insert_ngram_layer_idx",
    "ngram_insert_all_layers",
    "enable_double_loop_split",
    "loop_middle_layers",
    "loop_share_kv",
    "enable_hyper_connection",
    "enable_mhc",
    "enable_h_res_identity",
    "enable_depth_attention",
)


def _parse_nanbeige(raw: dict[str, Any]) -> LoopedLMConfig:
    _refuse_common(raw)
    for flag in _NANBEIGE_UNSUPPORTED:
        if raw.get(flag):
            raise ConfigError(f"Nanbeige option {flag!r} is not supported (field {flag!r})")
    return LoopedLMConfig(
        model_type="nanbeige",
        num_loops=_int(raw, "num_loops", 1),
        sandwich_norm=False,
        has_exit_gate=False,
        norm_every_loop=not raw.get("skip_loop_final_norm", False),
        **_common_fields(raw),
    )
