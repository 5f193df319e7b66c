"""benchmarks/bench_kernel_clock.py's layer time line (--timeline), from made-up probe stamps."""

from __future__ import annotations

import benchmark_scripts
import pytest
import torch

pytest.importorskip("triton")


def test_layer_timeline_puts_every_kernel_on_the_qkv_wait_clock():
    bench = benchmark_scripts.load("bench_kernel_clock")
    fields = bench.PROBE_FIELDS
    layer = {}
    for i, name in enumerate(bench.GEMMS):  # two programs each, the kernels 10 us apart (ns)
        base = 10_000 * i
        stamps = {
            "start": 0,
            "waited": 2_000,
            "x_ready": 2_500,
            "mma_done": 6_000,
            "end": 7_000,
            "producer_start": -500,
            "ring_full": 1_000,
            "last_issued": 5_000,
        }
        rows = [[base + stamps[f] + j * 100 for f in fields] for j in range(2)]  # fmt: skip
        layer[f"{name}_probe"] = torch.tensor(rows, dtype=torch.int64)
    # attention between the qkv and the o_proj: start, waited, end, cycles, then its phases;
    # a split without keys left before its wait, stamping nothing
    layer["probe"] = torch.tensor(
        [[7_000, 8_000, 9_000, 0, 0, 0, 8_100, 8_500, 8_800]] * 3 + [[-1] * 9], dtype=torch.int64
    )
    line = bench.layer_timeline(layer, bench.GEMMS)
    assert list(line) == ["qkv", "attention", "o", "gate_up", "down"]
    # the zero: the qkv's median wait return (torch's median: the lower middle value, 2 us)
    assert line["qkv"]["waited"] == 0.0
    assert line["qkv"]["start"] == pytest.approx(-2.5)  # its producers began first
    assert line["qkv"]["end"] == pytest.approx(5.1)  # the last program's end
    assert line["qkv"]["placed"] == pytest.approx(-2.5)  # the median producer's start
    assert line["attention"] == pytest.approx(
        {"start": 5.0, "placed": 5.0, "waited": 6.0, "keys_done": 6.8, "end": 7.0}
    )
    assert line["down"]["ring_full"] == pytest.approx(29.0)
    # a GEMM the table runs off the ws kernel (Nanbeige's gate/up) carries no probe: it stays
    # off the line, and the others keep their places
    del layer["gate_up_probe"]
    line = bench.layer_timeline(layer, ("qkv", "o", "down"))
    assert list(line) == ["qkv", "attention", "o", "down"]
    assert line["down"]["ring_full"] == pytest.approx(29.0)


def test_layer_timeline_places_the_add_norms_and_leaves_out_an_unprobed_attention():
    """--timeline's add + norm marks (norm_chain.PROBE_FIELDS: start, waited, loaded, end) go
    after the GEMM before each; an attention without a probe, or none of whose programs
    stamped it, stays off."""
    bench = benchmark_scripts.load("bench_kernel_clock")
    waited = bench.PROBE_FIELDS.index("waited")
    qkv = torch.zeros(3, len(bench.PROBE_FIELDS), dtype=torch.int64)
    qkv[:, waited] = torch.tensor([1_000, 2_000, 3_000])
    layer = {"qkv_probe": qkv}
    for name, base in (("norm_o", 20_000), ("norm_down", 40_000)):  # start waited loaded end
        layer[f"{name}_probe"] = torch.tensor(
            [[base, base + 1_000, base + 2_500, base + 3_000 + 100 * j] for j in range(2)]
        )
    assert bench.NORM_FIELDS == ("start", "waited", "loaded", "end")
    assert bench.qkv_wait_ns(layer) == 2_000.0
    line = bench.layer_timeline(layer, ("qkv",))
    assert list(line) == ["qkv", "norm_o", "norm_down"]
    layer["probe"] = torch.full((4, 9), -1, dtype=torch.int64)
    assert list(bench.layer_timeline(layer, ("qkv",))) == ["qkv", "norm_o", "norm_down"]
    assert line["norm_o"] == pytest.approx(
        {"start": 18.0, "placed": 18.0, "waited": 19.0, "loaded": 20.5, "end": 21.1}
    )
    assert line["norm_down"]["end"] == pytest.approx(41.1)


def test_attention_phases_split_a_programs_time_after_its_wait():
    bench = benchmark_scripts.load("bench_kernel_clock")
    assert len(bench.ATTENTION_FIELDS) == 9
    ran = [7_000, 8_000, 9_000, 0, 0, 0, 8_100, 8_500, 8_800]  # ns: waited 8.0 ... end 9.0
    padding = [-1] * 9  # a program past its sequence's queries returns before any stamp
    phases = bench.attention_phases(torch.tensor([ran, padding], dtype=torch.int64))
    assert phases == pytest.approx(
        {"metadata": [0.1], "first_tile": [0.4], "other_tiles": [0.3], "store": [0.2]}
    )
