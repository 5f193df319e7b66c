"""How much of the MLP's gate/up weight decode attention should ask L2 for (kernels/pdl.py's
`Ahead`, RLT_L2_AHEAD_MB), end to end.

    PYTHONPATH=. python benchmarks/bench_l2_ahead.py --out $OUT [--mb 0 16 8 24 0] \\
        [--concurrency 1 8] [--model nanbeige4.2-3b]

One engine per budget (the model's dummy bf16 weights, Ouro-1.4B by default, 8 slots,
64-token prompts, 32 outputs, depth 4), the budget set before the engine is built so its CUDA
graphs capture it; committed decode tok/s (h200_decode._median_rate, median of 5). A budget
listed twice (0 first and last, by default) shows the drift over the run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from rlt_engine.kernels import pdl  # noqa: E402


def main() -> None:
    import h200_decode  # the device's benchmark helpers (imports torch, CUDA)

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mb", type=float, nargs="*", default=[0, 16, 8, 24, 0])
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--model", choices=["ouro-1.4b", "nanbeige4.2-3b"], default="ouro-1.4b")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = {"ouro-1.4b": h200_decode.OURO, "nanbeige4.2-3b": h200_decode.NANBEIGE}[args.model]
    committed = pdl.AHEAD_BYTES
    rows = []
    try:
        for mb in args.mb:
            pdl.AHEAD_BYTES = int(mb * (1 << 20))
            llm = h200_decode._engine(path, max_num_seqs=8)
            for c in args.concurrency:
                r = h200_decode._median_rate(llm, c, repeats=5)
                rows.append({"model": args.model, "ahead_mb": mb, **r})
                print(json.dumps(rows[-1]), flush=True)
            del llm
    finally:
        pdl.AHEAD_BYTES = committed
    (args.out / f"l2_ahead-{args.model}.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
