"""benchmarks/bench_norm_warps.py: its rule changes Ouro's width only, and starts from the
committed count (a change to norm.num_warps_for must show up here)."""

from __future__ import annotations

import benchmark_scripts

from rlt_engine.kernels.norm import num_warps_for


def test_the_rule_changes_only_ouros_width():
    bench = benchmark_scripts.load("bench_norm_warps")
    rule = bench.warps_rule(2, num_warps_for)
    assert rule(bench.WIDTH_BLOCK) == 2
    for block in (64, 512, 1024, 4096, 8192):
        assert rule(block) == num_warps_for(block)
    assert num_warps_for(bench.WIDTH_BLOCK) == 8  # what the benchmark's docstring compares
