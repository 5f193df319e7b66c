"""benchmarks/graph_variants_cpu.py: the scheduler replayed on the CPU, each plan keyed as the
worker keys its CUDA graphs (small runs: this checks the script and its keys, not a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "graph_variants_cpu.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def _report(*args: str) -> dict:
    done = _run(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_lone_request_needs_only_start_up_graphs():
    # one 64-token prompt: a single-sequence wave of 64 rows, then decode windows of batch 1
    report = _report("-c", "1", "--num-prompts", "1", "--output-len", "4")
    keys = {tuple(v["key"]): v for v in report["variants"]}
    assert set(keys) == {("prefill", 64), ("decode", 1, False)}
    assert all(v["at_start"] for v in keys.values()) and report["first_use"] == []
    assert report["long_context_variants"] == 0


def test_contexts_past_long_context_take_the_other_plan_captured_at_start_up():
    # the plan follows the context, not the tables: admission reserves the whole request (150
    # prompt tokens and 64 to go: 14 blocks of 16 = 224 keys from the first window on), yet
    # the first windows attend to fewer than 200 keys and take the short plan
    report = _report("-c", "2", "--num-prompts", "2", "--input-len", "150", "--output-len", "64")
    keys = {tuple(v["key"]): v for v in report["variants"]}
    assert set(keys) == {("prefill", 512), ("decode", 2, False), ("decode", 2, True)}
    assert keys[("decode", 2, False)]["first_plan"] < keys[("decode", 2, True)]["first_plan"]
    assert report["long_context_variants"] == 1 and report["first_use"] == []


def test_staggered_arrivals_ride_in_graphs_captured_at_start_up():
    report = _report("-c", "8", "--num-prompts", "40", "--output-len", "8", "--jitter", "3")
    variants = report["variants"]
    rides = sum(v["uses"] for v in variants if v["key"][0] == "ride")
    assert rides == report["riding_plans"] > 0
    for v in variants:
        kind, *shape = v["key"]
        assert v["uses"] >= 1 and 0 <= v["first_plan"] < report["plans"]
        if kind == "ride":  # (batch, rows) buckets and the attention plan
            batch, rows, long = shape
            assert batch in (1, 2, 4, 8) and rows in (16, 32, 64, 128, 256, 512) and not long
        assert v["at_start"]  # every default variant is captured at start-up
    first = [e["plan"] for e in report["first_use"]]
    assert first == sorted(first) and len(first) == sum(not v["at_start"] for v in variants)


def test_bad_settings_name_the_flag():
    done = _run("--jitter", "-1")
    assert done.returncode == 2 and "--jitter must be >= 0" in done.stderr
