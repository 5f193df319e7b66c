"""benchmarks/bench_decode_splits.py: the rules it compares, and that `upto SHORT_SPLIT_SEQS`
is the one committed (a change to decode_splits must show up here)."""

from __future__ import annotations

import benchmark_scripts

from rlt_engine.kernels.paged_attention import SHORT_SPLIT_SEQS, SPLIT_SEQS, decode_splits


def test_upto_short_split_seqs_is_the_committed_rule():
    rule = benchmark_scripts.load("bench_decode_splits").rule(SHORT_SPLIT_SEQS)
    for long_context in (False, True):
        for n in range(1, 300):
            assert rule(n, long_context) == decode_splits(n, long_context), (n, long_context)


def test_rules_split_short_batches_up_to_their_bound_and_long_ones_as_committed():
    rule = benchmark_scripts.load("bench_decode_splits").rule
    assert [rule(4)(n, False) for n in (1, 2, 4, 5, 8)] == [2, 2, 4, 1, 1]  # 1-2: the wide tile
    assert [rule(4)(n, True) for n in (1, 2, 4, 5, 8)] == [16, 8, 4, 4, 4]
    assert rule(0)(1, False) == 1
    assert rule(0)(SPLIT_SEQS, True) == 4 and rule(0)(SPLIT_SEQS + 1, True) == 1
