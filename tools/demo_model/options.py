"""Training options (every one a command-line flag) and the command line itself."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import __doc__ as RECIPE
from .data import default_data_dir


@dataclass
class TrainOptions:
    out: Path
    data_dir: Path = field(default_factory=default_data_dir)
    log: Path | None = None  # default: <out>/training_log.json
    device: str = "auto"
    seed: int = 0
    # Data and tokenizer
    vocab_size: int = 4096
    seq_len: int = 256
    val_docs: int = 200  # last problems of train.jsonl, held out for monitoring
    max_docs: int | None = None  # smoke runs use a few hundred problems
    chat_every: int = 4  # every k-th problem as a ChatML chat (0: none)
    retrain_tokenizer: bool = False
    # Architecture (Ouro keys; 4 loops)
    hidden_size: int = 256
    num_layers: int = 3
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 768
    num_loops: int = 4
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    # Stage 1
    steps: int = 2000
    batch_size: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dropout: float = 0.3  # on embeddings and on each residual branch (training only)
    gate_bias_init: float = -1.4  # λ ≈ 0.2: most exit mass starts on the deepest loop
    keep_best: bool = True  # end stage 1 at the evaluation with the lowest val CE at full depth
    beta: float = 0.1  # entropy bonus at the start ...
    beta_final: float = 0.05  # ... annealed linearly to this
    # Stage 2 (gate only)
    gate_steps: int = 300
    gate_lr: float = 3e-3
    gate_margin: float = 0.05  # nats a later loop must gain for the token to keep looping
    # Logging
    log_every: int = 50
    eval_every: int = 200
    eval_batches: int = 8
    amp: bool = True  # bf16 autocast on CUDA

    @classmethod
    def smoke(cls, out: Path, **overrides: Any) -> TrainOptions:
        """A seconds-long CPU run exercising every code path (tests, pre-flight checks)."""
        values: dict[str, Any] = dict(
            vocab_size=384,
            seq_len=64,
            val_docs=16,
            max_docs=240,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            intermediate_size=128,
            steps=6,
            batch_size=4,
            warmup=2,
            gate_steps=3,
            log_every=2,
            eval_every=3,
            eval_batches=2,
        )
        values.update(overrides)
        return cls(out=out, **values)


def parse_args(argv: Sequence[str] | None = None) -> tuple[TrainOptions, bool]:
    """Command line -> (options, tokenizer_only)."""
    defaults = TrainOptions(out=Path("."))
    p = argparse.ArgumentParser(description=RECIPE, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--tokenizer-only", action="store_true", help="write tokenizer + config only")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (seconds) of every stage")
    for name, value in asdict(defaults).items():
        if name == "out":
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        elif name in ("data_dir", "log"):
            p.add_argument(flag, type=Path, default=None)
        elif name == "max_docs":
            p.add_argument(flag, type=int, default=None)
        else:
            p.add_argument(flag, type=type(value), default=None, help=f"default {value}")
    ns = vars(p.parse_args(argv))
    out, tokenizer_only, smoke = ns.pop("out"), ns.pop("tokenizer_only"), ns.pop("smoke")
    given = {k: v for k, v in ns.items() if v is not None}
    if smoke:
        given.setdefault("device", "cpu")
        return TrainOptions.smoke(out, **given), tokenizer_only
    return TrainOptions(out=out, **given), tokenizer_only
