"""Screen decode-chain variants in one process by the chain's unprobed replay (GPU only).

    PYTHONPATH=. python benchmarks/screen_chain.py --out $OUT --rows 8 \
      --variant 'o_split2;2048x2048:m8:bfloat16=("ws", 64, 256, 2, 4, 3, 0, 0)' \
      --variant 'wide4;kernels.paged_attention.WIDE_TILE_SEQS=4'

bench_kernel_clock's chain of decode layers (its `Chain`: the engine's launches for `rows`
decode sequences at `keys` keys, attention as the engine launches it, RoPE + the K/V write in
the qkv's epilogue, the split-K partials summed by the add + norms), captured without any
stamp once for the table and constants as they are ("base") and once per `--variant
NAME;ITEM[;ITEM...]`, each ITEM a small-GEMM table row (`KEY=ROW`, as ab_decode.py's --row) or
a module constant (`module.NAME=VALUE`, as its --set), applied before that variant's chain is
built and captured and undone after. Then `--rounds` rounds replay every graph in turn (the
order rotated each round), each time the median of `--replays` replays by CUDA events; per
variant the median over rounds in us per layer, its change against base, and how far its
chain's output lies from base's (`wrong` past WRONG_REL_ERR: a variant that computes something
else is reported, never timed as a gain).

Why: in session 44 this replay ordered two attention forms as the end-to-end A/B did (the
wide tile at 2 rows 3.4% shorter, c=2 +3.2%) where the kernel's stamps ordered them the wrong
way, and forms that launch the same kernels differed by 0.2-0.3%
(results/2026-12-07-wide-tile-four-seqs-h100.md). A variant costs a capture and a few seconds
of replays instead of an engine's start and decode runs: screen many here, then A/B the few
that gain with ab_decode.py, which stays the verdict. A row whose key no GEMM of the chain
looks up at any --rows is an error (it would time base twice); at a --rows where none of a
variant's rows applies and it sets nothing, the variant is skipped.

`--ab-args DIR` writes, for each variant whose layer is at least `--gain` percent shorter than
base's at some --rows, best first, `DIR/NN-NAME.args`: ab_decode.py's arguments for it (its
@FILE form, one a line: the label, the model, the screened rows as concurrencies, its --set and
--row items), `DIR/base.args` (the same without a variant) and `DIR/winners.json`.
`benchmarks/screen_then_ab.sh` runs the screen and those A/Bs in one device call.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

# (scripts beside this one)
from ab_decode import apply_rows, apply_sets, parse_row, parse_set  # noqa: E402
from bench_kernel_clock import MODELS, Chain, Dims, capture, replay_us  # noqa: E402

from rlt_engine.kernels.small_gemm import table_key  # noqa: E402

NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass
class Variant:
    name: str
    rows: list[tuple[str, tuple]] = field(default_factory=list)  # small-GEMM table rows
    sets: list[tuple[str, str, object]] = field(default_factory=list)  # module constants


def parse_variant(text: str) -> Variant:
    """'NAME;KEY=ROW;module.NAME=VALUE' -> a Variant: items that start with a digit are table
    rows (an "NxK:mB:dtype" key), the others module constants."""
    name, *items = [part.strip() for part in text.split(";")]
    if not NAME.fullmatch(name) or name == "base" or not items:
        raise ValueError(
            "--variant expects NAME;ITEM[;ITEM...] (NAME of letters, digits, '_', '-' or '.', "
            f"not 'base': it becomes an A/B label and a file name), got {text!r}"
        )
    variant = Variant(name)
    for item in items:
        if item[:1].isdigit():
            variant.rows.append(parse_row(item))
        else:
            variant.sets.append(parse_set(item))
    return variant


def chain_keys(dims: Dims, rows: int) -> set[str]:
    """The small-GEMM table keys the chain's four weight GEMMs look up at `rows` rows."""
    d = dims.heads * dims.d
    shapes = [((dims.heads + 2 * dims.kv_heads) * dims.d, dims.hidden), (dims.hidden, d)]
    shapes += [(2 * dims.inter, dims.hidden), (dims.hidden, dims.inter)]
    return {table_key(n, k, rows, torch.bfloat16) for n, k in shapes}


def applies(variant: Variant, keys: set[str]) -> bool:
    return bool(variant.sets) or any(key in keys for key, _ in variant.rows)


def check_rows(variants: list[Variant], dims: Dims, rows: list[int]) -> None:
    """Every variant row's key must be one the chain looks up at some of `rows`."""
    looked_up = set().union(*(chain_keys(dims, r) for r in rows))
    for variant in variants:
        for key, _ in variant.rows:
            if key not in looked_up:
                raise ValueError(
                    f"--variant {variant.name}: no GEMM of the chain looks up {key} at "
                    f"--rows {' '.join(map(str, rows))} (it would time base twice)"
                )


class Applied:
    """A variant's rows and constants in place for a `with` block, undone after; a key the
    table lacks or a name the module lacks is an error."""

    def __init__(self, variant: Variant, entries: dict | None) -> None:
        self.variant, self.entries = variant, entries
        self.undo: list = []

    def __enter__(self) -> None:
        try:
            self._apply()
        except BaseException:
            self.__exit__()  # what was applied before the error
            raise

    def _apply(self) -> None:
        # the values to restore, then ab_decode's own --set / --row (their checks: a name the
        # module lacks, a key the table lacks, a row of the wrong length)
        for module, attr, _ in self.variant.sets:
            mod = importlib.import_module(f"rlt_engine.{module}")
            if hasattr(mod, attr):
                self.undo.append((setattr, mod, attr, getattr(mod, attr)))
        entries = self.entries or {}
        for key, _ in self.variant.rows:
            if key in entries:
                self.undo.append((dict.__setitem__, entries, key, entries[key]))
        try:
            apply_sets(self.variant.sets)
            apply_rows(self.variant.rows, self.entries)
        except ValueError as exc:
            raise ValueError(f"--variant {self.variant.name}: {exc}") from None

    def __exit__(self, *exc: object) -> None:
        for undo, target, name, old in reversed(self.undo):
            undo(target, name, old)
        self.undo.clear()


def rotated(names: list[str], turn: int) -> list[str]:
    turn %= len(names)
    return names[turn:] + names[:turn]


# A variant whose chain output lies further than this from base's (relative L2 norm), or is not
# finite, computes something else: flagged `wrong`, never a winner. Other split-K orders round
# differently (base's own 0), far below this; a partial no program wrote, far above it.
WRONG_REL_ERR = 0.25


def output_errors(outputs: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per variant, its chain output's L2 distance from base's over base's norm (inf where
    not finite)."""
    base = outputs["base"].double().cpu()
    errors = {}
    for name, out in outputs.items():
        out = out.double().cpu()
        finite = bool(torch.isfinite(out).all())
        errors[name] = float((out - base).norm() / base.norm()) if finite else math.inf
    return errors


def summarize(
    times: dict[str, list[float]], layers: int, errors: dict[str, float] | None = None
) -> dict[str, dict]:
    """Per variant: its rounds (us per layer), their median, its change against base, and
    (`errors`) its output's distance from base's and whether that makes it `wrong`."""
    per_layer = {name: [t / layers for t in ts] for name, ts in times.items()}
    base = statistics.median(per_layer["base"])
    out = {}
    for name, ts in per_layer.items():
        out[name] = {
            "us_per_layer": statistics.median(ts),
            "rounds": ts,
            "change_pct": 100.0 * (statistics.median(ts) / base - 1.0),
        }
        if errors is not None:
            out[name]["output_rel_err"] = errors[name]
            out[name]["wrong"] = not errors[name] <= WRONG_REL_ERR
    return out


def screen(
    variants: list[Variant], rows: int, keys: int, layers: int, replays: int, rounds: int,
    dims: Dims, entries: dict | None,
) -> dict:  # fmt: skip
    looked_up = chain_keys(dims, rows)
    chosen = [Variant("base")] + [v for v in variants if applies(v, looked_up)]
    graphs, outputs = {}, {}
    for variant in chosen:
        with Applied(variant, entries):
            chain = Chain(rows, keys, layers, qkv_rope=True, unreduced=True, dims=dims,
                          engine_attention=True)  # fmt: skip

            def body(c: Chain = chain, name: str = variant.name) -> None:
                outputs[name] = c.run(probes=False)  # captured last: the graph's output

            # the chain kept with its graph: it holds the graph's buffers
            graphs[variant.name] = (chain, capture(body))
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for turn in range(rounds):
        for name in rotated(list(graphs), turn):
            times[name].append(replay_us(graphs[name][1], replays))
    errors = output_errors(outputs)  # (every graph replayed: each output is its own)
    skipped = [v.name for v in variants if v.name not in graphs]
    variants_out = summarize(times, layers, errors)
    for name, v in variants_out.items():
        if v["wrong"]:
            print(f"screen_chain: {name} at {rows} rows is wrong (output {v['output_rel_err']:.3g}"
                  " from base's): not a winner", file=sys.stderr)  # fmt: skip
    return {"rows": rows, "keys": keys, "variants": variants_out, "skipped": skipped}


def winners(results: list[dict], gain_pct: float) -> list[tuple[str, float]]:
    """(name, its largest shortening's change in percent) of each variant whose layer is at
    least `gain_pct` percent shorter than base's at some screened row count, best first; a
    variant `wrong` at any row count is none."""
    best: dict[str, float] = {}
    wrong = {n for r in results for n, v in r["variants"].items() if v.get("wrong")}
    for result in results:
        for name, v in result["variants"].items():
            if name != "base" and name not in wrong:
                best[name] = min(best.get(name, math.inf), v["change_pct"])
    return sorted(((n, c) for n, c in best.items() if c <= -gain_pct), key=lambda nc: nc[1])


def ab_args(variant: Variant, rows: list[int], model: str) -> list[str]:
    """ab_decode.py's arguments, one a line (its @FILE form), that run `variant` (base: the
    tree as it is) in the engine of `model` at the screened row counts as concurrencies."""
    lines = [f"--label={variant.name}", f"--model={model}"]
    lines += ["--concurrency=" + ",".join(map(str, rows))]
    lines += [f"--set={module}.{attr}={value!r}" for module, attr, value in variant.sets]
    lines += [f"--row={key}={row!r}" for key, row in variant.rows]
    return lines


def write_ab_args(
    directory: Path, variants: list[Variant], results: list[dict], rows: list[int],
    gain_pct: float, model: str,
) -> list[Path]:  # fmt: skip
    """`winners` as ab_decode.py argument files, DIR/NN-NAME.args best first, beside
    DIR/base.args (the tree as it is, the same model and concurrencies) and DIR/winners.json;
    returns the winners' files."""
    directory.mkdir(parents=True, exist_ok=True)
    write = lambda path, v: path.write_text("\n".join(ab_args(v, rows, model)) + "\n")  # noqa: E731
    write(directory / "base.args", Variant("base"))
    by_name = {v.name: v for v in variants}
    chosen = winners(results, gain_pct)
    files = []
    for i, (name, _) in enumerate(chosen, 1):
        files.append(directory / f"{i:02d}-{name}.args")
        write(files[-1], by_name[name])
    summary = {"gain_pct": gain_pct, "winners": [{"name": n, "change_pct": c} for n, c in chosen]}
    (directory / "winners.json").write_text(json.dumps(summary, indent=1) + "\n")
    return files


def parser() -> argparse.ArgumentParser:
    """The command line; `@FILE` stands for FILE's lines, one argument a line (a variants
    file: its --variant lines, and the --rows / --model it is meant for)."""
    ap = argparse.ArgumentParser(fromfile_prefix_chars="@")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", choices=sorted(MODELS), default="ouro")
    ap.add_argument("--rows", type=int, nargs="*", default=[8], help="sequences in decode")
    ap.add_argument("--keys", type=int, default=96)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--variant", dest="variants", action="append", default=[], type=parse_variant,
        metavar="NAME;ITEM[;ITEM...]", help="see the module docstring",
    )  # fmt: skip
    ap.add_argument("--ab-args", type=Path, help="write the winners' ab_decode.py @FILEs here")
    ap.add_argument("--gain", type=float, default=0.5, help="percent of a layer (--ab-args)")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.gain < 0:
        raise SystemExit(f"--gain must be >= 0 (percent of a layer), got {args.gain}")
    names = [v.name for v in args.variants]
    if len(set(names)) != len(names):
        raise SystemExit("--variant: two variants share a name")
    dims = MODELS[args.model]
    check_rows(args.variants, dims, args.rows)
    if not torch.cuda.is_available():
        raise SystemExit("screen_chain.py times CUDA graphs: it needs a CUDA GPU")
    from rlt_engine.kernels import small_gemm

    table = small_gemm.serving_table(torch.device("cuda", 0))
    entries = None if table is None else table["entries"]
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for rows in args.rows:
        shape = (rows, args.keys, args.layers, args.replays, args.rounds)
        results.append(screen(args.variants, *shape, dims, entries))
        print(json.dumps(results[-1]), flush=True)
    (args.out / "screen_chain.json").write_text(json.dumps(results, indent=1) + "\n")
    if args.ab_args is not None:
        files = write_ab_args(
            args.ab_args, args.variants, results, args.rows, args.gain, args.model
        )
        print(f"{len(files)} variant(s) to A/B: " + " ".join(f.name for f in files), flush=True)


if __name__ == "__main__":
    main()
