"""The whole run: GSM8K text, tokenizer, config.json, model, both stages, model.safetensors
and training_log.json; `main` is the command line's entry."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from rlt_engine.checkpoints.loader import init_dummy_weights, save_checkpoint
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.models.configs import parse_config
from rlt_engine.models.registry import model_class

from .backend import add_dropout
from .data import documents, encode_documents, epoch_windows, load_problems, training_batches
from .options import TrainOptions, parse_args
from .tokenizer import load_saved_tokenizer, save_tokenizer, train_tokenizer, write_json
from .trainer import Trainer


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def make_deterministic(seed: int, device: torch.device) -> None:
    if device.type == "cuda":
        # Must be set before cuBLAS creates its first handle.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)


def model_config(opts: TrainOptions) -> dict[str, Any]:
    """config.json with the keys of the real Ouro-1.4B config (minus its remote-code auto_map)."""
    return {
        "architectures": ["OuroForCausalLM"],
        "attention_dropout": 0.0,
        "pad_token_id": 0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "head_dim": opts.head_dim,
        "hidden_act": "silu",
        "hidden_size": opts.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": opts.intermediate_size,
        "layer_types": ["full_attention"] * opts.num_layers,
        "max_position_embeddings": opts.max_position_embeddings,
        "max_window_layers": opts.num_layers,
        "model_type": "ouro",
        "num_attention_heads": opts.num_heads,
        "num_hidden_layers": opts.num_layers,
        "num_key_value_heads": opts.num_kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": opts.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "total_ut_steps": opts.num_loops,
        "early_exit_threshold": 1.0,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": opts.vocab_size,
    }


def write_config(cfg: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", cfg)


def prepare_tokenizer(opts: TrainOptions, docs: Sequence[str], reuse: bool) -> Any:
    """Reuse the tokenizer already in `out` (keeps committed files byte-stable), or train one."""
    path = opts.out / "tokenizer.json"
    if reuse and path.is_file() and not opts.retrain_tokenizer:
        tok = load_saved_tokenizer(opts.out)
        if tok.get_vocab_size() != opts.vocab_size:
            raise SystemExit(
                f"{path} has {tok.get_vocab_size()} tokens, not --vocab-size {opts.vocab_size}; "
                "pass --retrain-tokenizer to replace it"
            )
        print(f"reusing tokenizer {path}", flush=True)
        return tok
    t0 = time.perf_counter()
    tok = train_tokenizer(docs, opts.vocab_size)
    save_tokenizer(tok, opts.out, opts.max_position_embeddings)
    print(f"trained tokenizer ({opts.vocab_size} tokens) in {time.perf_counter() - t0:.1f}s")
    return tok


def build_model(opts: TrainOptions, device: torch.device) -> LoopedCausalLM:
    cfg = parse_config(model_config(opts))
    model: LoopedCausalLM = model_class(cfg.model_type)(cfg)
    init_dummy_weights(model, opts.seed)  # N(0, 0.02) matrices, unit norms, zero biases
    with torch.no_grad():
        model.model.early_exit_gate.bias.fill_(opts.gate_bias_init)
    return model.to(device).train()


def save_bf16(model: LoopedCausalLM, out: Path) -> int:
    """Write model.safetensors in bf16; returns its size in bytes."""
    state = {name: t.detach().to(torch.bfloat16) for name, t in model.state_dict().items()}
    (path,) = save_checkpoint(state, out)
    path.chmod(0o644)  # safetensors writes 0600; package data must be world-readable
    return path.stat().st_size


def train(opts: TrainOptions, tokenizer_only: bool = False) -> dict[str, Any]:
    """Run the whole recipe; returns the training log (also written as JSON)."""
    device = pick_device(opts.device)
    make_deterministic(opts.seed, device)
    problems = load_problems(opts.data_dir / "train.jsonl", opts.max_docs)
    docs = documents(problems, opts.chat_every)
    tok = prepare_tokenizer(opts, docs, reuse=not tokenizer_only)
    write_config(model_config(opts), opts.out)
    if tokenizer_only:
        return {}

    encoded = encode_documents(tok, docs)
    train_docs, val_docs = encoded[: -opts.val_docs], encoded[-opts.val_docs :]
    val = epoch_windows(val_docs, opts.seq_len, opts.seed, epoch=0)[
        : opts.eval_batches * opts.batch_size
    ]
    model = build_model(opts, device)
    params = sum(p.numel() for p in model.parameters())
    tokens = sum(d.numel() for d in train_docs)
    print(
        f"device {device}  params {params:,}  train tokens {tokens:,} in {len(train_docs)} docs  "
        f"val windows {val.shape[0]}  steps {opts.steps} + gate {opts.gate_steps}",
        flush=True,
    )
    trainer = Trainer(opts, model, device)
    batches = training_batches(train_docs, opts.seq_len, opts.batch_size, opts.seed)
    hooks = add_dropout(model, opts.dropout)
    trainer.stage1(batches, val)
    for hook in hooks:
        hook.remove()
    stage1_seconds = trainer.seconds()
    trainer.stage2(batches, val)
    size = save_bf16(model, opts.out)
    log: dict[str, Any] = {
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "parameters": params,
        "train_tokens_per_epoch": tokens,
        "epochs": opts.steps * opts.batch_size * opts.seq_len / tokens,
        "stage1_best_step": trainer.best_step,
        "seconds_stage1": stage1_seconds,
        "seconds_total": trainer.seconds(),
        "checkpoint_bytes": size,
        **trainer.log,
    }
    log_path = opts.log or opts.out / "training_log.json"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(json.dumps(log, indent=1) + "\n")
    print(f"wrote {opts.out} ({size:,} bytes of weights) and {log_path}", flush=True)
    return log


def main(argv: Sequence[str] | None = None) -> int:
    opts, tokenizer_only = parse_args(argv)
    train(opts, tokenizer_only)
    return 0
