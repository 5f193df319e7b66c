"""benchmarks/weight_passes.py: the weight passes a plan trace costs (the count that
`weight_passes.py` and `h200_decode.py --only adaptive` compare schedules by)."""

from __future__ import annotations

import benchmark_scripts

from rlt_engine.core.plan import PrefillChunk, StepPlan


def _module():  # type: ignore[no-untyped-def]
    return benchmark_scripts.load("weight_passes")


def test_a_traversal_reads_the_weights_once_a_lone_wave_once_per_loop_a_riding_wave_never():
    wave = (PrefillChunk("a", 0, 0, (1, 2, 3), last=True),)
    plans = [
        StepPlan(prefill=(wave,)),  # alone: depth passes
        StepPlan(decode_traversals=5),
        StepPlan(prefill=(wave,), decode_traversals=4, wave_rides=True),  # rides: none extra
        StepPlan(prefill=(wave, wave), decode_traversals=2),  # two waves alone (SHARED)
    ]
    assert _module().weight_passes(plans, depth=4) == 4 + 5 + 4 + (2 + 2 * 4)
