"""Warps per row program of the decode norms (kernels/norm.num_warps_for), end to end.

    PYTHONPATH=. python benchmarks/bench_norm_warps.py --out $OUT [--warps 8 4 2 8] \\
        [--concurrency 1 8]

The add + norm launches run one program per row; at Ouro's width (2,048, the block of the
committed 8 warps) each costs ~2.2 us of added time in decode, two a layer, almost all of it
latency (two loads, two cross-warp reductions, two stores). Fewer warps mean fewer barriers per
reduction and more elements per thread. One engine per warp count (Ouro-1.4B dummy bf16, 8
slots, 64-token prompts, 32 outputs, depth 4), the count patched for 2,048-wide rows before the
engine is built (rms_norm and add_rms_norm both read num_warps_for: the same reduction tree,
so the chained = plain equality holds; the fp32 sums change order, so a count that wins must
pass the exact suite before it is committed). A count listed twice shows the drift. Measured
on the H200 (results/2026-12-02-l2-ahead-h200.md): 8 (committed) is best, 4 -0.5%, 2 -1.5%.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from rlt_engine.kernels import norm  # noqa: E402

WIDTH_BLOCK = 2048  # Ouro-1.4B's hidden size, a power of two


def warps_rule(warps: int, committed: Callable[[int], int]) -> Callable[[int], int]:
    """num_warps_for with `warps` for WIDTH_BLOCK-element rows, `committed` elsewhere."""
    return lambda block: warps if block == WIDTH_BLOCK else committed(block)


def main() -> None:
    import h200_decode  # the device's benchmark helpers (imports torch, CUDA)

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--warps", type=int, nargs="*", default=[8, 4, 2, 8])
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    committed = norm.num_warps_for
    rows = []
    try:
        for warps in args.warps:
            norm.num_warps_for = warps_rule(warps, committed)
            llm = h200_decode._engine(h200_decode.OURO, max_num_seqs=8)
            for c in args.concurrency:
                r = h200_decode._median_rate(llm, c, repeats=5)
                rows.append({"warps": warps, **r})
                print(json.dumps(rows[-1]), flush=True)
            del llm
    finally:
        norm.num_warps_for = committed
    (args.out / "norm_warps.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
