"""The demo-model training program (tools/train_demo_model.py, code in tools/demo_model/) and
its report, on CPU.

A `--smoke` run (seconds) must produce a directory the product loads with `load_model` and
`load_tokenizer`, with finite loss terms; the training-only pieces (attention backend, exit
distribution, gate targets) must agree with the product's semantics.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

TOOLS_DIR = Path(__file__).resolve().parents[2] / "tools"
if str(TOOLS_DIR) not in sys.path:
    sys.path.insert(0, str(TOOLS_DIR))

import demo_model_report  # noqa: E402
import train_demo_model  # noqa: E402
from demo_model.backend import CausalSDPABackend, loop_hiddens  # noqa: E402
from demo_model.data import (  # noqa: E402
    EOS,
    SPECIAL_TOKENS,
    chat_document,
    clean_answer,
    documents,
    load_problems,
    plain_document,
)
from demo_model.objective import exit_log_probs, gate_logits, gate_targets, ouro_objective  # noqa: E402
from demo_model.options import TrainOptions, parse_args  # noqa: E402
from demo_model.tokenizer import save_tokenizer, train_tokenizer  # noqa: E402
from demo_model.train import main, train  # noqa: E402

from rlt_engine.checkpoints.loader import load_model  # noqa: E402
from rlt_engine.models.tokenizer import load_tokenizer, render_chat_text  # noqa: E402
from rlt_engine.oracle.reference import reference_forward  # noqa: E402


@pytest.fixture(scope="module")
def gsm8k_dir(shared_dir: Path) -> Path:
    path = shared_dir / "datasets" / "gsm8k"
    if not (path / "train.jsonl").is_file():
        pytest.skip(f"GSM8K is absent from {path}")
    return path


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory, gsm8k_dir: Path) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("demo-smoke")
    opts = TrainOptions.smoke(out, data_dir=gsm8k_dir, device="cpu")
    log = train(opts)
    return out, log


def _finite(values: Any) -> bool:
    if isinstance(values, list):
        return all(_finite(v) for v in values)
    return math.isfinite(float(values))


def test_smoke_run_writes_a_loadable_checkpoint(smoke_run: tuple[Path, dict]) -> None:
    out, log = smoke_run
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    model = load_model(out, dtype=torch.float32)
    assert model.config.model_type == "ouro"
    assert model.num_loops == 4 and model.config.has_exit_gate
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tokenizer = load_tokenizer(out)
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2]
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == 0
    assert json.loads((out / "training_log.json").read_text())["parameters"] == log["parameters"]


def test_smoke_run_loss_terms_are_finite(smoke_run: tuple[Path, dict]) -> None:
    _, log = smoke_run
    assert log["train"] and log["val"] and log["gate"]
    for entry in log["train"]:
        for key in ("loss", "expected_ce", "entropy", "ce_per_loop", "exit_mass"):
            assert _finite(entry[key]), (key, entry)
        assert sum(entry["exit_mass"]) == pytest.approx(1.0, abs=1e-3)
    for entry in log["val"]:
        assert _finite(entry["ce_per_loop"]) and len(entry["ce_per_loop"]) == 4
    assert all(_finite(entry["bce"]) for entry in log["gate"])
    # A few steps of training already lower the training loss.
    assert log["train"][-1]["loss"] < log["train"][0]["loss"]


def test_chat_documents_match_the_saved_chat_template(smoke_run: tuple[Path, dict]) -> None:
    out, _ = smoke_run
    tokenizer = load_tokenizer(out)
    question, answer = "What is 2+3?", "2+3 = <<2+3=5>>5\n#### 5"
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": clean_answer(answer)},
    ]
    rendered = render_chat_text(tokenizer, messages, add_generation_prompt=False)
    assert rendered + EOS == chat_document(question, answer)
    assert "<<" not in plain_document(question, answer)
    ids = tokenizer.encode(plain_document(question, answer), add_special_tokens=False)
    assert ids[-1] == 0 and tokenizer.decode(ids) == plain_document(question, answer)


def test_tokenizer_training_is_deterministic(gsm8k_dir: Path, tmp_path: Path) -> None:
    docs = documents(load_problems(gsm8k_dir / "train.jsonl", 150), chat_every=4)
    for name in ("a", "b"):
        save_tokenizer(train_tokenizer(docs, 400), tmp_path / name, 2048)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_training_backend_matches_the_dense_oracle(smoke_run: tuple[Path, dict]) -> None:
    """Every loop over whole sequences with CausalSDPABackend = the oracle at full depth."""
    out, _ = smoke_run
    model = load_model(out, dtype=torch.float32)
    ids = torch.tensor([[0, 5, 17, 42, 9, 3, 77, 100], [0, 8, 8, 1, 2, 250, 31, 6]])
    hiddens = loop_hiddens(model, ids, CausalSDPABackend())
    state = model.state_dict()
    for row in range(ids.shape[0]):
        ref = reference_forward(state, model.config, ids[row])
        for loop, hidden in enumerate(hiddens):
            got = hidden.view(2, ids.shape[1], -1)[row]
            torch.testing.assert_close(got, ref.hidden[loop], atol=1e-4, rtol=1e-4)
            hazards = torch.sigmoid(gate_logits(model, got))
            assert ref.hazards is not None
            torch.testing.assert_close(hazards, ref.hazards[loop], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(model.exit_hazard(got), hazards)


def test_exit_distribution_is_the_ouro_one() -> None:
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(0)) * 3
    p = exit_log_probs(logits).exp()
    lam = torch.sigmoid(logits)
    expected = torch.stack(
        [
            lam[0],
            lam[1] * (1 - lam[0]),
            lam[2] * (1 - lam[0]) * (1 - lam[1]),
            (1 - lam[0]) * (1 - lam[1]) * (1 - lam[2]),  # remaining mass: the last hazard unused
        ]
    )
    torch.testing.assert_close(p, expected)
    torch.testing.assert_close(p.sum(0), torch.ones(7))
    ce = torch.rand(4, 7)
    terms = ouro_objective(ce, exit_log_probs(logits), beta=0.1)
    entropy = -(expected * expected.log()).sum(0).mean()
    torch.testing.assert_close(terms.loss, (expected * ce).sum(0).mean() - 0.1 * entropy)


def test_gate_targets_stop_once_later_loops_stop_helping() -> None:
    # Token 0 improves only at the last loop; token 1 is done after loop 1; token 2 after 2.
    ce = torch.tensor([[3.0, 1.0, 2.0], [3.0, 1.0, 1.0], [3.0, 1.02, 1.0], [1.0, 0.99, 1.01]])
    targets = gate_targets(ce, margin=0.05)
    assert targets.T.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]]


def test_report_runs_on_the_smoke_checkpoint(
    smoke_run: tuple[Path, dict], gsm8k_dir: Path, tmp_path: Path
) -> None:
    out, _ = smoke_run
    report_path = tmp_path / "report.json"
    argv = ["--model", str(out), "--data-dir", str(gsm8k_dir), "--problems", "4"]
    argv += ["--samples", "1", "--max-new-tokens", "4", "--out", str(report_path)]
    assert demo_model_report.main(argv) == 0
    report = json.loads(report_path.read_text())
    assert len(report["heldout"]["ce_per_loop"]) == 4
    for summary in report["exit"]:
        assert sum(summary["histogram"].values()) == report["heldout"]["tokens"]
    assert report["samples"][0]["full_depth"]["tokens"] <= 4


def test_command_line_maps_flags_onto_options(tmp_path: Path) -> None:
    assert train_demo_model.main is main  # the script is a thin entry point
    opts, tokenizer_only = parse_args(["--out", str(tmp_path), "--smoke", "--steps", "9"])
    expected = TrainOptions.smoke(tmp_path, steps=9, device="cpu")
    assert (opts, tokenizer_only) == (expected, False)
    argv = ["--out", str(tmp_path), "--tokenizer-only", "--no-amp", "--max-docs", "5"]
    opts, tokenizer_only = parse_args(argv)
    assert tokenizer_only and not opts.amp and opts.max_docs == 5
    assert opts.vocab_size == TrainOptions(out=tmp_path).vocab_size
