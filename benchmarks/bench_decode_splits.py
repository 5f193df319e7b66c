"""Which decode batches should split their keys (paged_attention.decode_splits), end to end.

    PYTHONPATH=. python benchmarks/bench_decode_splits.py --out $OUT [--upto 0 1 2 4 8]

One engine per rule (Ouro-1.4B dummy bf16, 8 slots, 64-token prompts, 32 outputs, depth 4):
short-context decode batches of n <= `upto` sequences split paged_attention.SHORT_SPLITS // n
ways (at least 1), merged in the attention kernel (0: none split), long contexts as
committed. Committed decode tok/s at c = 1, 2, 4, 8 (h200_decode._median_rate), the rule
patched before the engine is built so its CUDA graphs capture it. The committed rule is
upto paged_attention.SHORT_SPLIT_SEQS = 2 (2026-12-02-l2-ahead-h200.md: c=2 +1.6% against
upto 1, c=4 -0.1% to -0.4% with 2 or 4, when short batches split four ways).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from rlt_engine.kernels import paged_attention  # noqa: E402

_COMMITTED = paged_attention.decode_splits  # bound here: main() patches the module's name


def rule(upto: int) -> Callable[[int, bool], int]:
    """decode_splits with short contexts splitting batches of at most `upto` sequences."""
    return partial(_COMMITTED, short_seqs=upto)


def main() -> None:
    import h200_decode  # the device's benchmark helpers (imports torch, CUDA)

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--upto", type=int, nargs="*", default=[0, 1, 2, 4, 8])
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 2, 4, 8])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for upto in args.upto:
            paged_attention.decode_splits = rule(upto)
            llm = h200_decode._engine(h200_decode.OURO, max_num_seqs=8)
            for c in args.concurrency:
                r = h200_decode._median_rate(llm, c, repeats=5)
                rows.append({"upto": upto, **r})
                print(json.dumps(rows[-1]), flush=True)
            del llm
    finally:
        paged_attention.decode_splits = _COMMITTED
    (args.out / "decode_splits.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
