"""Which form decode launches each weight GEMM in, for the bundled model configs (the tests of
the ws kernel's rows and of the screens' variants files)."""

from __future__ import annotations

import json

from rlt_engine.checkpoints.resolve import KNOWN_CONFIGS


def decode_forms() -> dict[tuple[int, int], dict]:
    """(N, K) of a weight -> {"rope_d": head dim} for a packed qkv (its RoPE epilogue),
    {"swiglu": True} for a packed gate/up; other weights are plain GEMMs (not listed)."""
    forms: dict[tuple[int, int], dict] = {}
    for path in sorted(KNOWN_CONFIGS.glob("*/config.json")):
        c = json.loads(path.read_text())
        h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        d = c.get("head_dim") or h // heads
        forms[((heads + 2 * kv) * d, h)] = {"rope_d": d}
        forms[(2 * c["intermediate_size"], h)] = {"swiglu": True}
    return forms
