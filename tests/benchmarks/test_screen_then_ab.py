"""benchmarks/screen_then_ab.sh's control flow on the CPU: the screen's winners A/B'd best
first, each alternated base / variant / variant / base, at most AB_MAX, and no ab_decode
process started past the deadline. The GPU steps are stood in for by `stand_in.py` below (run
as the script's PYTHON): it writes the winners' files with screen_chain's own code from fixed
changes, and parses each ab_decode command line with ab_decode's own parser."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import benchmark_scripts
import pytest

pytest.importorskip("triton")

ROOT = benchmark_scripts.ROOT
STAND_IN = """
import json, os, sys, time
sys.path[:0] = [{root!r}, {root!r} + "/benchmarks", {root!r} + "/tests"]
import benchmark_scripts
script, args = os.path.basename(sys.argv[1]), sys.argv[2:]
if script == "screen_chain.py":
    screen = benchmark_scripts.load("screen_chain")
    a = screen.parser().parse_args(args)
    changes = json.loads(os.environ["CHANGES"])
    results = [{{"rows": r, "variants": {{"base": {{"change_pct": 0.0}},
        **{{v.name: {{"change_pct": changes[v.name]}} for v in a.variants}}}}}} for r in a.rows]
    screen.write_ab_args(screen.Path(a.ab_args), a.variants, results, a.rows, a.gain,
                        a.model)
elif script == "ab_decode.py":
    a = benchmark_scripts.load("ab_decode").parser().parse_args(args)
    time.sleep(float(os.environ.get("AB_SLEEP", "0")))
    row = {{"label": a.label, "model": a.model, "sets": [list(s) for s in a.sets],
           "tokens_sha": "t"}}
    row.update({{f"c{{c}}": 100.0 for c in a.concurrency.split(",")}})
    with open(a.out / "ab.jsonl", "a") as f:
        f.write(json.dumps(row) + "\\n")
else:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def _run(
    tmp_path: Path, changes: dict, *screen_args: str, **env: str
) -> tuple[subprocess.CompletedProcess, list]:
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN.format(root=str(ROOT)))
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {stand_in} "$@"\n')
    python.chmod(0o755)
    variants = tmp_path / "variants"
    variants.write_text(
        "".join(f"--variant={n};kernels.paged_attention.SHORT_SPLITS={i}\n" for i, n in
                enumerate(changes, 1))
    )  # fmt: skip
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", "benchmarks/screen_then_ab.sh", str(out), str(variants),
         *(screen_args or ("--rows", "1", "8"))],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHON": str(python), "CHANGES": json.dumps(changes), **env},
    )  # fmt: skip
    jsonl = out / "ab.jsonl"
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    return proc, rows


def test_the_winners_are_alternated_with_base_best_first_at_most_ab_max(tmp_path):
    changes = {"a": -0.8, "b": -2.0, "c": 0.3, "d": -0.6}
    proc, rows = _run(tmp_path, changes, AB_MAX="2")
    assert proc.returncode == 0, proc.stderr
    assert [r["label"] for r in rows] == ["base", "b", "b", "base", "base", "a", "a", "base"]
    assert rows[1]["sets"] == [["kernels.paged_attention", "SHORT_SPLITS", 2]]
    assert all(set(r) >= {"c1", "c8"} and r["model"] == "ouro" for r in rows)
    assert "| b |" in (tmp_path / "out" / "ab.md").read_text()
    assert "2 variant(s) A/B'd" in proc.stdout


def test_no_ab_decode_process_starts_past_the_deadline(tmp_path):
    # the stand-in screen takes S seconds (it imports torch: 1-17 s on a loaded CI machine), an
    # A/B process 10: the first starts (18 - S >= AB_FIRST_S), the second, with 8 - S s left,
    # does not fit a process as long as the first
    proc, rows = _run(tmp_path, {"a": -1.0}, AB_SLEEP="10", DEADLINE_S="18", AB_FIRST_S="1")
    assert proc.returncode == 0, proc.stderr
    assert [r["label"] for r in rows] == ["base"]
    assert "not run" in proc.stderr


def test_nothing_is_ab_d_when_no_variant_gains(tmp_path):
    proc, rows = _run(tmp_path, {"a": -0.4, "b": 0.0})
    assert proc.returncode == 0, proc.stderr
    assert rows == []
    assert "0 variant(s) A/B'd" in proc.stdout


def test_the_screens_model_and_rows_carry_to_base_and_variant_alike(tmp_path):
    proc, rows = _run(tmp_path, {"a": -1.0}, "--model", "nanbeige", "--rows", "2")
    assert proc.returncode == 0, proc.stderr
    assert [(r["label"], r["model"]) for r in rows] == [
        ("base", "nanbeige"),
        ("a", "nanbeige"),
        ("a", "nanbeige"),
        ("base", "nanbeige"),
    ]
    assert all(set(r) == {"label", "model", "sets", "tokens_sha", "c2"} for r in rows)
