"""Summarise an A/B call's `ab_decode.py` rows (OUT/ab.jsonl) as the results notes give them.

    python benchmarks/ab_summary.py OUT/ab.jsonl [--base LABEL] [--json]

One line per label, in the order the labels first ran: each rate column's medians (one per
process: `ab_decode` runs each variant in its own process, alternated, e.g. base new new
base), their mean's change against the base label's (the first label unless `--base`), and
whether the variant's greedy tokens hash as the base's. Markdown by default (a table for the
notes), one JSON object with `--json`.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

# the rate columns ab_decode writes: c{concurrency} and c{concurrency}_p{prompt length}
RATE = re.compile(r"^c\d+(_p\d+)?$")


def load(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{path}: no A/B rows")
    return rows


def summarise(rows: list[dict], base: str | None = None) -> dict:
    """{"base", "columns", "labels": {label: {"runs": {col: [...]}, "change": {col: %},
    "tokens", "same_tokens"}}}: the columns every base row has, labels in their first run's
    order; a label run at fewer concurrencies has no runs and no change in the others."""
    labels: dict[str, list[dict]] = {}
    for row in rows:
        labels.setdefault(row["label"], []).append(row)
    base = base or rows[0]["label"]
    if base not in labels:
        raise SystemExit(f"--base {base!r}: no such label (have {', '.join(labels)})")
    first = labels[base][0]
    columns = [k for k in first if RATE.match(k) and all(k in r for r in labels[base])]
    mean = {c: statistics.fmean(r[c] for r in labels[base]) for c in columns}
    base_tokens = {r["tokens_sha"] for r in labels[base]}
    out = {"base": base, "columns": columns, "labels": {}}
    for label, group in labels.items():
        tokens = sorted({r["tokens_sha"] for r in group})
        out["labels"][label] = {
            "runs": {c: [r[c] for r in group if c in r] for c in columns},
            "change": {
                c: 100.0 * (statistics.fmean(r[c] for r in group if c in r) / mean[c] - 1.0)
                for c in columns
                if any(c in r for r in group)
            },
            "tokens": tokens,
            "same_tokens": set(tokens) == base_tokens,
        }
    return out


def markdown(summary: dict) -> str:
    columns = summary["columns"]
    head = ["variant", *(c.replace("_p", ", prompts ").replace("c", "c=", 1) for c in columns)]
    lines = ["| " + " | ".join([*head, "tokens"]) + " |", "|" + "---|" * (len(head) + 1)]
    for label, s in summary["labels"].items():
        cells = []
        for c in columns:
            runs = " / ".join(f"{v:,.1f}" for v in s["runs"][c])
            if label == summary["base"] or c not in s["change"]:
                cells.append(runs)  # (empty where the label did not run this column)
            else:
                cells.append(f"{runs} ({s['change'][c]:+.1f}%)")
        tokens = ", ".join(t[:8] for t in s["tokens"])
        if label != summary["base"] and not s["same_tokens"]:
            tokens += " (differ)"
        lines.append("| " + " | ".join([label, *cells, tokens]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path, help="an ab_decode.py OUT/ab.jsonl")
    ap.add_argument("--base", help="the label to compare against (default: the first)")
    ap.add_argument("--json", action="store_true", help="one JSON object, not Markdown")
    args = ap.parse_args(argv)
    summary = summarise(load(args.path), args.base)
    sys.stdout.write((json.dumps(summary) if args.json else markdown(summary)) + "\n")


if __name__ == "__main__":
    main()
