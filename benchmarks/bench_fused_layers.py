"""A/B of the fused decode layer chain on the same code and GPU: `rlt bench` / `rlt profile` with
the chain on (as shipped) or, with --unfused, off: every residual add and the norm after it as
two launches (the layers' plain `forward`) and RoPE then the K/V write as two launches.

    python benchmarks/bench_fused_layers.py [--unfused] bench --model M --load-format dummy -c 8
    python benchmarks/bench_fused_layers.py [--unfused] profile --model M ... --json

Everything after the optional flag is `rlt`'s own command line.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlt_cli.main import app
from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.worker.attention import TritonPagedAttention


def unfuse() -> None:
    """The fast path without the layer chain: plain layer loop, apply_rope_ then write_kv_."""
    fast_path = LoopedCausalLM.use_fast_path

    def use_fast_path(self: LoopedCausalLM) -> None:
        fast_path(self)
        self.chained_norms = False

    LoopedCausalLM.use_fast_path = use_fast_path  # type: ignore[method-assign]
    TritonPagedAttention.attend_rope = None  # type: ignore[assignment,method-assign]


if __name__ == "__main__":
    if "--unfused" in sys.argv[1:2]:
        del sys.argv[1]
        unfuse()
    app(prog_name="rlt")
