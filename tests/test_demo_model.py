"""The bundled demo checkpoint: loads like any real checkpoint, agrees with the oracle, ships
in the wheel and is the default model when nothing else is available."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlt_engine.checkpoints.loader import load_model
from rlt_engine.checkpoints.resolve import DEMO_DIR, resolve_model_dir
from rlt_engine.models.configs import load_config
from rlt_engine.models.tokenizer import load_tokenizer, render_chat
from rlt_engine.oracle.contiguous_kv import ContiguousKVCache, ContiguousMetadata
from rlt_engine.oracle.reference import reference_forward

REPO = Path(__file__).resolve().parents[1]
QUESTION = "Question: Natalia sold 48 clips in April and half as many in May. How many in total?"


def test_demo_checkpoint_is_small_and_an_ouro():
    total = sum(f.stat().st_size for f in DEMO_DIR.iterdir() if f.is_file())
    assert total <= 12 * 2**20
    cfg = load_config(DEMO_DIR)
    assert cfg.model_type == "ouro" and cfg.num_loops == 4 and cfg.has_exit_gate
    assert resolve_model_dir("demo") == DEMO_DIR


# Modules vs the dense oracle in fp32 on the 28-token question: logits (up to |21.8|) differ by at
# most 8.6e-6 (a few ulps at that magnitude), hazards by 2.4e-7. Bounds ~3.5x and ~4x (rtol=0:
# the absolute error is what stays put; the old rtol=atol=1e-4 allowed up to 2e-3 on big logits).
LOGIT_ATOL = 3e-5
HAZARD_ATOL = 1e-6


@torch.inference_mode()
def test_modules_equal_the_oracle_on_the_demo_checkpoint():
    model = load_model(DEMO_DIR, dtype=torch.float32)
    tok = load_tokenizer(DEMO_DIR)
    ids = torch.tensor(tok.encode(QUESTION + "\nAnswer:"))
    cache = ContiguousKVCache(model.config, 1, len(ids))
    pos, zeros = torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long)
    ref = reference_forward(model.state_dict(), model.config, ids)
    hidden = model.prelude(ids)
    for loop in range(model.num_loops):
        out = model.recurrent(hidden, ContiguousMetadata(pos, zeros + loop, zeros), cache)
        hidden = out.hidden
        torch.testing.assert_close(model.coda(hidden), ref.logits[loop], rtol=0, atol=LOGIT_ATOL)
        torch.testing.assert_close(out.hazard, ref.hazards[loop], rtol=0, atol=HAZARD_ATOL)


def test_demo_tokenizer_has_a_chat_template():
    tok = load_tokenizer(DEMO_DIR)
    ids = render_chat(tok, [{"role": "user", "content": "2 + 2?"}])
    text = tok.decode(ids)
    assert "<|im_start|>user\n2 + 2?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_wheel_ships_the_demo_model(tmp_path):
    """Build the wheel, install it outside the source tree, and load the default model."""
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(REPO)],
        check=True,
        cwd=tmp_path,
    )
    site = tmp_path / "site"
    wheel = next(wheels.glob("rlt-*.whl"))
    subprocess.run(
        [*pip, "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        cwd=tmp_path,
    )
    code = (
        "import rlt_engine, sys\n"
        "from rlt_engine import LLM, SamplingParams\n"
        "assert 'site' in rlt_engine.__file__, rlt_engine.__file__\n"
        "llm = LLM('demo', device='cpu')\n"
        "out = llm.generate('Question: 2 apples and 3 apples?', SamplingParams(max_tokens=4))\n"
        "print(len(out[0].token_ids))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) >= 1
