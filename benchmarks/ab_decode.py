"""A/B of the decode path: one engine per process, its `rlt_engine` taken from a tree, so two
commits (or one commit with some module constants set otherwise) run on one machine.

    git archive BASE rlt_engine ':!rlt_engine/assets' | tar -x -C $TREES/base   # a base tree
    PYTHONPATH=. python benchmarks/ab_decode.py --out $OUT --label base-1 --tree $TREES/base
    PYTHONPATH=. python benchmarks/ab_decode.py --out $OUT --label new-1 \\
        --set kernels.paged_attention.SHORT_SPLITS=8 --long 1:960 --long 2:2000
    PYTHONPATH=. python benchmarks/ab_decode.py --out $OUT --label gu-3-stages \\
        --row '11264x2048:m1:bfloat16=("ws", 128, 128, 1, 4, 3, 0, 0)'

A run: Ouro-1.4B config (`--model nanbeige`: Nanbeige4.2-3B's), dummy bf16 weights
(`h200_decode._engine`, as many slots as the largest concurrency asked, at least 8, so c=64 runs
64 sequences at once); committed decode tok/s (`h200_decode._median_rate`: 64-token prompts, 32
outputs, fixed depth 4) at each `--concurrency` (5 repeats) and at each `--long C:PROMPT_LEN` (3
repeats); then the sha256 of the greedy token ids of 8 prompts (equal hashes: the variants' bf16
outputs agree). One JSON line on stdout, appended to OUT/ab.jsonl. `--set` applies before the
engine is built, so its CUDA graphs capture the change; so does `--row KEY=ROW`, which replaces
one row of the small-GEMM table this GPU takes (kernels/small_gemm_tables: a GEMM config tried
in place);
`--engine NAME=VALUE` passes an engine argument (`--engine incremental_kv=False --engine
enable_preemption=False`: the KV reservation instead of growth). H200
machines differ by a few percent: alternate the variants within one device call (base, new,
new, base) and compare only rows of one call; `benchmarks/ab_summary.py OUT/ab.jsonl` gives
them as a table of changes against the base.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_set(text: str) -> tuple[str, str, object]:
    """'kernels.paged_attention.SHORT_SPLITS=8' -> ('kernels.paged_attention', 'SHORT_SPLITS',
    8): a module of rlt_engine, one of its names, a Python literal."""
    target, sep, value = text.partition("=")
    module, dot, attr = target.rpartition(".")
    if not sep or not dot or not module or not attr:
        raise ValueError(f"--set expects module.NAME=VALUE, got {text!r}")
    try:
        literal = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise ValueError(f"--set {target}: {value!r} is not a Python literal") from None
    return module, attr, literal


def parse_engine(text: str) -> tuple[str, object]:
    """'incremental_kv=False' -> ('incremental_kv', False): an `LLM(...)` keyword argument."""
    name, sep, value = text.partition("=")
    try:
        literal = ast.literal_eval(value) if sep and name.isidentifier() else None
    except (ValueError, SyntaxError):
        literal = None
    if literal is None:
        raise ValueError(f"--engine expects NAME=VALUE (a Python literal), got {text!r}")
    return name, literal


def parse_long(text: str) -> tuple[int, int]:
    """'2:960' -> (concurrency 2, prompt length 960)."""
    c, sep, pl = text.partition(":")
    if not sep or not c.isdigit() or not pl.isdigit() or int(c) < 1 or int(pl) < 1:
        raise ValueError(f"--long expects CONCURRENCY:PROMPT_LEN, got {text!r}")
    return int(c), int(pl)


def slots_for(concurrencies: list[int], longs: list[tuple[int, int]]) -> int:
    """Engine slots: the largest concurrency asked (at least 8, the token-hash workload); fewer
    would queue the rest and measure a smaller batch under a larger label."""
    return max([8, *concurrencies, *(c for c, _ in longs)])


def use_tree(tree: Path) -> Path:
    """Import rlt_engine from `tree` (a directory holding the package); refuses when another
    copy is already imported, which would silently measure that one instead."""
    tree = tree.resolve()
    if not (tree / "rlt_engine" / "__init__.py").is_file():
        raise ValueError(f"--tree {tree}: no rlt_engine package there")
    loaded = sys.modules.get("rlt_engine")
    if loaded is None:
        sys.path.insert(0, str(tree))
        loaded = importlib.import_module("rlt_engine")
    origin = Path(loaded.__file__).resolve()
    if not origin.is_relative_to(tree):
        raise ValueError(f"--tree {tree}: rlt_engine is already imported from {origin.parent}")
    return origin.parent


def parse_row(text: str) -> tuple[str, tuple]:
    """'11264x2048:m1:bfloat16=("ws", 128, 128, 1, 4, 3, 0, 0)' -> (key, row): a small-GEMM
    table key and a row of small_gemm_tables.FIELDS."""
    key, sep, value = text.partition("=")
    try:
        row = ast.literal_eval(value) if sep else None
    except (ValueError, SyntaxError):
        row = None
    if not isinstance(row, tuple) or key.count(":") != 2:
        raise ValueError(f"--row expects NxK:mB:dtype=(backend, block_n, ...), got {text!r}")
    return key, row


def apply_rows(rows: list[tuple[str, tuple]], entries: dict | None) -> None:
    """Replace rows of `entries` (the small-GEMM table this GPU takes) before any GEMM reads it;
    no table, a key it lacks or a row of the wrong length is an error (it would measure the
    table unchanged)."""
    from rlt_engine.kernels.small_gemm_tables import FIELDS

    if rows and entries is None:
        raise ValueError("--row: no small-GEMM table serves this GPU")
    for key, row in rows:
        if key not in entries:  # type: ignore[operator]
            raise ValueError(f"--row: the table has no {key}")
        if len(row) != len(FIELDS):
            raise ValueError(f"--row {key}: {len(FIELDS)} fields, got {len(row)}")
        entries[key] = row  # type: ignore[index]


def apply_gpu_rows(rows: list[tuple[str, tuple]]) -> None:
    """`apply_rows` on the table the first GPU takes (kernels/small_gemm.serving_table)."""
    if not rows:
        return
    import torch

    from rlt_engine.kernels import small_gemm

    table = small_gemm.serving_table(torch.device("cuda", 0))
    apply_rows(rows, None if table is None else table["entries"])


def apply_sets(sets: list[tuple[str, str, object]]) -> None:
    """Set each name on its rlt_engine module; a name the module lacks is an error (a typo
    would otherwise measure the base twice)."""
    for module, attr, value in sets:
        mod = importlib.import_module(f"rlt_engine.{module}")
        if not hasattr(mod, attr):
            raise ValueError(f"--set: rlt_engine.{module} has no {attr}")
        setattr(mod, attr, value)


def parser() -> argparse.ArgumentParser:
    """The command line; `@FILE` stands for FILE's lines, one argument a line (e.g. the
    `--row=KEY=ROW` lines a tuner's rows are kept in)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], fromfile_prefix_chars="@")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--tree", type=Path, default=ROOT, help="a directory holding rlt_engine")
    ap.add_argument("--set", dest="sets", action="append", default=[], type=parse_set)
    ap.add_argument("--row", dest="rows", action="append", default=[], type=parse_row)
    ap.add_argument("--engine", dest="engine", action="append", default=[], type=parse_engine)
    ap.add_argument("--concurrency", default="1,8", help="comma-separated, 64-token prompts")
    ap.add_argument("--long", action="append", default=[], type=parse_long)
    ap.add_argument(
        "--model",
        choices=("ouro", "nanbeige"),
        default="ouro",
        help="Ouro-1.4B (MHA) or Nanbeige4.2-3B (GQA, 8 kv heads for 48) config, dummy weights",
    )
    return ap


def main() -> None:
    args = parser().parse_args()
    package = use_tree(args.tree)
    apply_sets(args.sets)
    apply_gpu_rows(args.rows)
    sys.path.insert(1, str(ROOT / "benchmarks"))
    import h200_decode as hd  # imports torch and the engine: after the tree is chosen

    t0 = time.time()
    concurrencies = [int(x) for x in args.concurrency.split(",") if x]
    model = {"ouro": hd.OURO, "nanbeige": hd.NANBEIGE}[args.model]
    slots = slots_for(concurrencies, args.long)
    llm = hd._engine(model, max_num_seqs=slots, **dict(args.engine))
    row: dict = {"label": args.label, "model": args.model, "rlt_engine": str(package)}
    row["set"] = [f"{m}.{a}={v!r}" for m, a, v in args.sets]
    row["set"] += [f"table[{k}]={v!r}" for k, v in args.rows]
    row["engine"] = {name: value for name, value in args.engine}
    for c in concurrencies:
        r = hd._median_rate(llm, c, repeats=5)
        row[f"c{c}"], row[f"c{c}_runs"] = r["decode_tok_s_median"], r["decode_tok_s_runs"]
    for c, pl in args.long:
        r = hd._median_rate(llm, c, prompt_len=pl, repeats=3)
        row[f"c{c}_p{pl}"] = r["decode_tok_s_median"]
    prompts, params = hd._workload(8, 64, 32)
    tokens = [list(map(int, o[0])) for o in hd._outs(llm, prompts, params[0])]
    row["tokens_sha"] = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
    row["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "ab.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
