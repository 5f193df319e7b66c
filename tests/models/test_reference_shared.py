"""The SHARED-layout oracle: equal to the reference at D == 1, a different function at D > 1,
self-consistent greedy decoding, and equal to the model modules run over a contiguous cache
whose loop index is always 0 (one plane, position by position through all loops)."""

from __future__ import annotations

import pytest
import torch

from rlt_engine.core.exit_rule import ExitTracker, LoopControls
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.models.configs import parse_config
from rlt_engine.models.registry import model_class
from rlt_engine.oracle.contiguous_kv import ContiguousKVCache, ContiguousMetadata
from rlt_engine.oracle.reference import ReferenceOutput, reference_forward, reference_greedy
from rlt_engine.oracle.reference_shared import shared_forward, shared_greedy

VOCAB = 96
RAW_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 16,  # not hidden/heads (12), as in Nanbeige
    "eos_token_id": 2,
    "bos_token_id": 1,
}
OURO = {**RAW_COMMON, "model_type": "ouro", "num_key_value_heads": 2, "total_ut_steps": 4}
NANBEIGE = {**RAW_COMMON, "model_type": "nanbeige", "num_key_value_heads": 2, "num_loops": 3}
SKIPNORM = {**NANBEIGE, "skip_loop_final_norm": True}
CONFIGS = {"ouro": OURO, "nanbeige": NANBEIGE, "nanbeige-skipnorm": SKIPNORM}
PROMPT = [5, 17, 42, 8, 77, 3, 61]
NEW_TOKENS = 8


def _build(raw: dict, seed: int = 5) -> LoopedCausalLM:
    cfg = parse_config(raw)
    torch.manual_seed(seed)
    model = model_class(cfg.model_type)(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # ones would hide a missing or misplaced norm
                param.copy_(1 + 0.1 * torch.randn_like(param))
        if cfg.has_exit_gate:  # spread hazards so adaptive exits really vary
            model.model.early_exit_gate.weight.mul_(12.0)
            model.model.early_exit_gate.bias.fill_(0.5)
    return model


# SHARED oracle vs the reference oracle and vs the modules: the largest error measured over this
# file, relative to max(1, max |expected|), is 6.2e-7. 2e-6 is ~3x that; 1e-5 allowed ~16x.
REL_TOL = 2e-6


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = max(1.0, float(expected.abs().max()))
    err = float((actual.float() - expected).abs().max())
    assert err <= REL_TOL * scale, f"max abs error {err:.3g} (scale {scale:.3g})"


def _close_outputs(a: ReferenceOutput, b: ReferenceOutput) -> None:
    _close(a.hidden, b.hidden)
    _close(a.logits, b.logits)
    assert (a.hazards is None) == (b.hazards is None)
    if a.hazards is not None:
        _close(a.hazards, b.hazards)


# ---------------------------------------------------------------- against the reference


@pytest.mark.parametrize("raw", [OURO, NANBEIGE, SKIPNORM], ids=list(CONFIGS))
def test_single_loop_equals_reference(raw: dict):
    one_loop = {**raw, "total_ut_steps" if raw["model_type"] == "ouro" else "num_loops": 1}
    model = _build(one_loop)
    sd, cfg = model.state_dict(), model.config
    _close_outputs(shared_forward(sd, cfg, PROMPT), reference_forward(sd, cfg, PROMPT))
    want = reference_greedy(sd, cfg, PROMPT, NEW_TOKENS)
    assert shared_greedy(sd, cfg, PROMPT, NEW_TOKENS) == want


@pytest.mark.parametrize("name", list(CONFIGS))
def test_deeper_models_are_a_different_function(name: str):
    model = _build(CONFIGS[name])
    sd, cfg = model.state_dict(), model.config
    shared, ref = shared_forward(sd, cfg, PROMPT), reference_forward(sd, cfg, PROMPT)
    # Position 0 attends only to itself: both agree there.
    _close(shared.logits[:, 0], ref.logits[:, 0])
    # Later tokens read the final (loop D-1) versions of earlier tokens at every loop.
    for loop in range(cfg.num_loops):
        diff = float((shared.logits[loop, 1:] - ref.logits[loop, 1:]).abs().max())
        assert diff > 1e-2, (loop, diff)


def test_exit_depths_are_validated():
    model = _build(OURO)
    with pytest.raises(ValueError, match="exit_depths"):
        shared_forward(model.state_dict(), model.config, [1, 2], [4, 5])
    with pytest.raises(ValueError, match="exit_depths"):
        shared_forward(model.state_dict(), model.config, [1, 2], [4])
    with pytest.raises(ValueError, match="empty"):
        shared_forward(model.state_dict(), model.config, [])


def test_exit_depths_shape_only_later_tokens():
    """A token's own exit depth changes what later tokens read, never its own outputs."""
    model = _build(OURO)
    sd, cfg = model.state_dict(), model.config
    full = shared_forward(sd, cfg, PROMPT)
    early = shared_forward(sd, cfg, PROMPT, [4, 4, 1, 4, 4, 4, 4])
    _close(early.logits[:, :3], full.logits[:, :3])
    assert float((early.logits[1:, 3:] - full.logits[1:, 3:]).abs().max()) > 1e-3


# ---------------------------------------------------------------- greedy self-consistency

GREEDY_CASES = [
    ("ouro", {}),
    ("ouro", {"exit_threshold": 0.6}),
    ("ouro", {"exit_threshold": 0.9, "min_loops": 2}),
    ("ouro", {"exit_threshold": 0.3, "max_loops": 3}),
    ("nanbeige", {}),
    ("nanbeige", {"max_loops": 2}),
    ("nanbeige-skipnorm", {"max_loops": 1}),
]


@pytest.mark.parametrize(("name", "kwargs"), GREEDY_CASES)
def test_greedy_is_self_consistent(name: str, kwargs: dict):
    model = _build(CONFIGS[name])
    sd, cfg = model.state_dict(), model.config
    tokens, depths = shared_greedy(sd, cfg, PROMPT, NEW_TOKENS, **kwargs)
    assert len(tokens) == len(depths) == NEW_TOKENS and depths[0] == cfg.num_loops
    sequence = PROMPT + tokens[:-1]
    exits = [cfg.num_loops] * len(PROMPT) + depths[1:]
    out = shared_forward(sd, cfg, sequence, exits)
    for k, (token, e) in enumerate(zip(tokens, depths, strict=True)):
        assert int(out.logits[e - 1, len(PROMPT) - 1 + k].argmax()) == token
    if "exit_threshold" in kwargs:
        assert len(set(depths[1:])) >= 2, depths  # the exits really vary


# ---------------------------------------------------------------- the modules, emulated SHARED


def _emulate_shared(
    model: LoopedCausalLM, ids: list[int], prompt_len: int, controls: LoopControls
) -> tuple[list[int], list[list[torch.Tensor]], list[list[torch.Tensor | None]]]:
    """Modules over a contiguous cache that always uses plane 0, one position at a time.

    Prompt positions run all loops; later positions stop where ExitTracker says. Returns the
    exit depths and, per position, the logits and hazards of each loop it ran.
    """
    cache = ContiguousKVCache(model.config, 1, len(ids))
    full = LoopControls(model.num_loops, model.num_loops, 1.0)
    exits, logits, hazards = [], [], []
    with torch.inference_mode():
        for pos, token in enumerate(ids):
            tracker = ExitTracker(full if pos < prompt_len else controls)
            meta = ContiguousMetadata(
                positions=torch.tensor([pos]),
                loop_indices=torch.zeros(1, dtype=torch.long),
                seq_ids=torch.zeros(1, dtype=torch.long),
            )
            hidden = model.prelude(torch.tensor([token]))
            logits.append([])
            hazards.append([])
            while True:
                out = model.recurrent(hidden, meta, cache)
                hidden = out.hidden
                logits[-1].append(model.coda(hidden)[0])
                hazards[-1].append(None if out.hazard is None else out.hazard[0])
                if tracker.step(None if out.hazard is None else float(out.hazard[0])):
                    break
            exits.append(tracker.loops_done)
    return exits, logits, hazards


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("threshold", [1.0, 0.6])
def test_oracle_equals_modules_on_one_plane(name: str, threshold: float):
    model = _build(CONFIGS[name])
    sd, cfg = model.state_dict(), model.config
    ids = [*PROMPT, 9, 33, 70, 2, 14, 55, 21, 90]
    controls = LoopControls(1, cfg.num_loops, threshold)
    exits, logits, hazards = _emulate_shared(model, ids, len(PROMPT), controls)
    if threshold == 1.0 or not cfg.has_exit_gate:
        assert exits == [cfg.num_loops] * len(ids)
    else:
        assert len(set(exits[len(PROMPT) :])) >= 2, exits
    oracle = shared_forward(sd, cfg, ids, exits)
    for pos, e in enumerate(exits):
        _close(torch.stack(logits[pos]), oracle.logits[:e, pos])
        if oracle.hazards is not None:
            _close(torch.stack(hazards[pos]), oracle.hazards[:e, pos])


@pytest.mark.parametrize(("threshold", "min_loops"), [(1.0, 1), (0.6, 1), (0.9, 2)])
def test_greedy_equals_modules_on_one_plane(threshold: float, min_loops: int):
    """Emulated SHARED greedy decoding with the modules gives the oracle's tokens and exits."""
    model = _build(OURO)
    sd, cfg = model.state_dict(), model.config
    controls = LoopControls(min_loops, cfg.num_loops, threshold)
    tokens, depths = shared_greedy(
        sd, cfg, PROMPT, NEW_TOKENS, min_loops=min_loops, exit_threshold=threshold
    )
    if threshold < 1.0:
        assert len(set(depths[1:])) >= 2, depths
    ids = PROMPT + tokens[:-1]
    exits, logits, _ = _emulate_shared(model, ids, len(PROMPT), controls)
    assert exits[len(PROMPT) :] == depths[1:]
    emulated = [int(logits[len(PROMPT) - 1 + k][-1].argmax()) for k in range(NEW_TOKENS)]
    assert emulated == tokens
