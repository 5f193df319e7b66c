"""The official Ouro code's outputs on a tiny random checkpoint (tests/fixtures/ouro-tiny-official,
copied from ../shared/golden; its README says how they were made).

`golden_dir(depth)` is the checkpoint configured with `total_ut_steps = depth`, which is how the
official code produced `greedy_by_depth[depth]`: every token, prompt included, runs `depth` loops.
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import torch
from safetensors.torch import load_file

GOLDEN_DIR = Path(__file__).resolve().parent / "fixtures" / "ouro-tiny-official"
DEPTH = 4  # total_ut_steps of the fixture's config


@cache
def golden_meta() -> dict:
    return json.loads((GOLDEN_DIR / "golden.json").read_text())


def prompts() -> list[list[int]]:
    return golden_meta()["prompts"]


def new_tokens() -> int:
    return golden_meta()["new_tokens"]


def greedy(depth: int) -> list[list[int]]:
    """The official greedy continuation of every prompt with the model set to `depth` loops."""
    return golden_meta()["greedy_by_depth"][str(depth)]


@cache
def tensors() -> dict[str, torch.Tensor]:
    """`prompt{i}.hidden` [loops, T, H], `.gate_logit` [loops, T], `.last_logits` [loops, V]."""
    return load_file(str(GOLDEN_DIR / "golden.safetensors"))


def golden_dir(root: Path, depth: int) -> Path:
    """A copy of the checkpoint whose config runs `depth` loops (weights linked, not copied)."""
    out = root / f"ouro-tiny-official-d{depth}"
    if out.is_dir():
        return out
    out.mkdir(parents=True)
    config = json.loads((GOLDEN_DIR / "config.json").read_text())
    config["total_ut_steps"] = depth
    (out / "config.json").write_text(json.dumps(config))
    try:
        (out / "model.safetensors").symlink_to(GOLDEN_DIR / "model.safetensors")
    except OSError:
        shutil.copy(GOLDEN_DIR / "model.safetensors", out / "model.safetensors")
    return out
