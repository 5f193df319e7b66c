"""The `rlt profile` summary on hand-built Chrome traces: nesting, phases, GPU busy, launches."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from rlt_engine.profile.trace import (
    FIRST,
    HOST_GAPS,
    PHASES,
    added_links,
    added_times,
    analyze,
    exclusive_segments,
    load_trace,
    union_length,
)

MAIN = {"pid": 1, "tid": 7}


def mark(name: str, ts: float, dur: float, **where: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur,
            **(where or MAIN)}  # fmt: skip


def launch(ts: float, corr: int, name: str = "cudaLaunchKernel") -> dict[str, Any]:
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 2.0,
            "args": {"correlation": corr}, **MAIN}  # fmt: skip


def kernel(name: str, ts: float, dur: float, corr: int, cat: str = "kernel") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
            "args": {"correlation": corr}, "pid": 0, "tid": 7}  # fmt: skip


def test_exclusive_segments_partition_nested_ranges() -> None:
    ranges = [(0, 100, "a"), (10, 40, "b"), (20, 30, "c"), (50, 120, "d"), (200, 210, "e")]
    segments = exclusive_segments(ranges)
    assert segments == [
        (0, 10, "a"), (10, 20, "b"), (20, 30, "c"), (30, 40, "b"), (40, 50, "a"),
        (50, 100, "d"),  # d pokes out of a: clipped to it
        (200, 210, "e"),
    ]  # fmt: skip
    assert union_length([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25


def gpu_trace() -> dict[str, Any]:
    """One 1,000 us workload: a prefill step, then a decode step whose window launches three
    kernels that run on past the window into the read back."""
    events = [
        mark("rlt.workload", 0, 1000),
        mark("rlt.add_request", 5, 10),
        mark("rlt.step", 20, 380),  # step 1: prefill + a first window
        mark("rlt.schedule", 25, 15),
        mark("rlt.execute", 40, 320),
        mark("rlt.prefill", 50, 100),
        mark("rlt.sample", 120, 20),
        mark("rlt.decode_window", 150, 50),
        mark("rlt.read_back", 200, 150),
        mark("rlt.update", 360, 30),
        mark("rlt.detokenize", 370, 10),
        mark("rlt.step", 420, 560),  # step 2: decode only
        mark("rlt.schedule", 420, 20),
        mark("rlt.execute", 440, 500),
        mark("rlt.decode_window", 450, 100),
        mark("rlt.read_back", 550, 380),
        mark("rlt.update", 940, 30),
        # a marker on another thread is not the engine's
        mark("rlt.prefill", 0, 999, pid=1, tid=8),
        launch(60, 1),
        kernel("prefill_gemm", 70, 100, 1),  # 70..170
        launch(125, 2),
        kernel("sampler", 175, 10, 2),  # 175..185
        launch(160, 3, "cudaGraphLaunch"),
        kernel("decode_gemm", 190, 100, 3),  # 190..290 (window span 150..360)
        launch(460, 4, "cuLaunchKernel"),
        kernel("decode_gemm", 470, 300, 4),  # 470..770
        launch(470, 5),
        kernel("attention", 770, 80, 5),  # 770..850
        launch(560, 6, "cudaMemcpyAsync"),
        kernel("Memcpy DtoH", 880, 10, 6, cat="gpu_memcpy"),  # 880..890
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaStreamSynchronize",
            "ts": 890,
            "dur": 30,
            "args": {},
            **MAIN,
        },
        {
            "ph": "X",
            "cat": "gpu_user_annotation",
            "name": "rlt.decode_window",
            "ts": 450,
            "dur": 500,
            "pid": 0,
            "tid": 7,
        },
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0},
    ]
    return {"traceEvents": events}


def test_phases_partition_the_wall_time() -> None:
    s = analyze(gpu_trace(), token_steps=4, traversals=16, top=3)
    phases = {p["phase"]: p for p in s["phases"]}
    assert [p["phase"] for p in s["phases"]] == [*(name for name, _ in PHASES), HOST_GAPS]
    assert s["wall_ms"] == 1.0 and s["steps"] == 2
    expected_us = {
        "schedule": 35,
        "bookkeeping": (320 - 100 - 50 - 150) + (500 - 100 - 380),  # execute's own time
        "prefill": 100 - 20,
        "sampling": 20,
        "decode_window": 150,
        "read_back": 530,
        "update": 20 + 30,
        "detokenize": 10,
        "add_requests": 10,
    }
    for name, us in expected_us.items():
        assert phases[name]["ms"] == pytest.approx(us / 1e3), name
    assert phases["read_back"]["calls"] == 2 and phases["detokenize"]["calls"] == 1
    assert s["phases_ms"] == pytest.approx(sum(expected_us.values()) / 1e3)
    assert s["host_gaps_ms"] == pytest.approx(1.0 - s["phases_ms"])
    assert phases[HOST_GAPS]["ms"] == s["host_gaps_ms"]
    # device time goes to the phase that launched it
    assert phases["prefill"]["gpu_ms"] == pytest.approx(0.1)
    assert phases["sampling"]["gpu_ms"] == pytest.approx(0.01)
    assert phases["decode_window"]["gpu_ms"] == pytest.approx(0.48)
    assert phases["read_back"]["gpu_ms"] == pytest.approx(0.01)


def test_gpu_busy_share_of_the_decode_windows() -> None:
    gpu = analyze(gpu_trace(), token_steps=4, traversals=16)["gpu"]
    # window spans run to the end of their execute: 150..360 and 450..940 = 700 us; device
    # activity inside: 150..170 (prefill's gemm still running) + 175..185 + 190..290
    # + 470..850 + 880..890 = 520 us
    assert gpu["decode_window_ms"] == pytest.approx(0.7)
    assert gpu["decode_window_busy_ms"] == pytest.approx(0.52)
    assert gpu["busy_share_decode_window"] == pytest.approx(520 / 700)
    # the decode-only step 420..980 holds 470..850 + 880..890
    assert gpu["decode_steps_ms"] == pytest.approx(0.56)
    assert gpu["busy_share_decode_steps"] == pytest.approx(390 / 560)
    # 70..170 + 175..185 + 190..290 + 470..850 + 880..890
    assert gpu["busy_ms"] == pytest.approx(0.6)
    assert gpu["busy_share_wall"] == pytest.approx(0.6)
    # kernels launched inside a window: decode_gemm x2 + attention (the sampler was launched
    # from prefill's sampling, the memcpy is no kernel)
    assert (gpu["kernels"], gpu["decode_kernels"]) == (5, 3)
    assert gpu["kernels_per_token_step"] == pytest.approx(3 / 4)
    assert gpu["kernels_per_traversal"] == pytest.approx(3 / 16)
    assert (gpu["launch_calls"], gpu["decode_launch_calls"]) == (5, 3)
    assert gpu["syncs"] == 1 and gpu["syncs_per_token_step"] == pytest.approx(1 / 4)


def test_sync_sites_by_phase_and_innermost_op() -> None:
    """Each synchronising call goes to the phase and the innermost torch op it ran in (a
    call outside any op is named by itself), most host time first."""

    def op(name: str, ts: float, dur: float, **where: Any) -> dict[str, Any]:
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur,
                **(where or MAIN)}  # fmt: skip

    def sync(ts: float, dur: float, **where: Any) -> dict[str, Any]:
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": ts,
                "dur": dur, "args": {}, **(where or MAIN)}  # fmt: skip

    trace = gpu_trace()
    trace["traceEvents"] += [
        op("aten::to", 60, 30),  # prefill 50..150
        op("aten::copy_", 62, 20),  # innermost: the pageable copy
        sync(65, 5),
        sync(70, 5),
        op("aten::item", 100, 10),
        op("aten::_local_scalar_dense", 101, 8),
        sync(102, 4),
        op("aten::item", 980, 5),  # after the workload's last step: host gaps
        sync(981, 1),
        sync(100, 50, pid=1, tid=8),  # another thread: not the engine's
    ]
    sites = analyze(trace, token_steps=4, traversals=16)["gpu"]["sync_sites"]
    assert sites == [
        {"phase": "read_back", "op": "cudaStreamSynchronize", "syncs": 1, "ms": 0.03},
        {"phase": "prefill", "op": "aten::copy_", "syncs": 2, "ms": 0.01},
        {"phase": "prefill", "op": "aten::_local_scalar_dense", "syncs": 1, "ms": 0.004},
        {"phase": HOST_GAPS, "op": "aten::item", "syncs": 1, "ms": 0.001},
    ]
    assert analyze(trace, token_steps=4, traversals=16, cuda=False)["gpu"]["sync_sites"] is None


def test_top_kernels_by_device_time() -> None:
    top = analyze(gpu_trace(), token_steps=4, traversals=16, top=2)["top"]
    assert top["kind"] == "cuda_kernels" and top["total_ms"] == pytest.approx(0.59)
    assert [(k["name"], k["calls"]) for k in top["items"]] == [
        ("decode_gemm", 2),
        ("prefill_gemm", 1),
    ]
    assert top["items"][0]["total_ms"] == pytest.approx(0.4)
    assert top["items"][0]["mean_us"] == pytest.approx(200)
    assert top["items"][0]["share"] == pytest.approx(0.4 / 0.59)


def test_added_time_is_each_kernels_end_past_the_previous_end_on_its_stream() -> None:
    """Overlapping kernels (PDL) add only their tail; an idle stream counts from the start;
    a kernel ending inside the one before adds nothing; streams are separate."""
    calls = [
        kernel("norm", 0, 10, 1),
        kernel("gemm", 5, 20, 2),  # starts under norm: adds 15 (10 -> 25)
        kernel("norm", 22, 6, 3),  # adds 3 (25 -> 28)
        kernel("tiny", 23, 2, 4),  # ends inside: adds 0
        kernel("gemm", 40, 10, 5),  # idle from 28 to 40: adds its 10
        {**kernel("gemm", 0, 7, 6), "tid": 8},  # another stream: its own 7
    ]
    assert added_times(calls) == {"norm": 13.0, "gemm": 32.0, "tiny": 0.0}


def test_top_kernels_carry_their_added_time() -> None:
    top = analyze(gpu_trace(), token_steps=4, traversals=16, top=2)["top"]
    assert top["added_ms"] == pytest.approx(top["total_ms"])  # these kernels never overlap
    gemm = top["items"][0]
    assert gemm["added_ms"] <= gemm["total_ms"]
    assert gemm["added_mean_us"] == pytest.approx(gemm["added_ms"] * 1e3 / gemm["calls"])
    assert 0 < gemm["added_share"] <= 1


def test_chain_links_each_kept_call_to_the_kernel_before_it() -> None:
    """A link is (the call with the latest end before, the call), keyed with the launch grid
    where the trace has one; its added time as `added_times`; calls not kept still move the
    stream's timeline; a stream's first call follows FIRST."""

    def grid(e, g):
        return {**e, "args": {**e["args"], "grid": g}}

    calls = [
        grid(kernel("norm", 0, 10, 1), [1, 1, 1]),
        grid(kernel("gemm", 5, 20, 2), [96, 1, 1]),  # under norm: adds 15
        grid(kernel("norm", 22, 6, 3), [1, 1, 1]),  # adds 3
        kernel("tiny", 23, 2, 4),  # ends inside norm: adds 0, and norm stays "before"
        grid(kernel("gemm", 40, 10, 5), [32, 4, 1]),  # idle before: adds its 10
        grid(kernel("gemm", 50, 10, 6), [96, 1, 1]),  # not kept: moves the timeline only
        grid(kernel("norm", 55, 8, 7), [1, 1, 1]),  # adds 3 after gemm [96, 1, 1]
    ]
    keep = [True, True, True, True, True, False, True]
    assert added_links(calls, keep) == {
        (FIRST, "norm [1, 1, 1]"): [10.0],
        ("norm [1, 1, 1]", "gemm [96, 1, 1]"): [15.0],
        ("gemm [96, 1, 1]", "norm [1, 1, 1]"): [3.0, 3.0],
        ("norm [1, 1, 1]", "tiny"): [0.0],
        ("norm [1, 1, 1]", "gemm [32, 4, 1]"): [10.0],
    }


def test_the_decode_chain_holds_the_windows_kernels_only() -> None:
    """The summary's chain: the kernels launched in decode windows (the prefill's GEMM and
    the sampler are not, but the first decode GEMM links to the sampler before it)."""
    chain = analyze(gpu_trace(), token_steps=4, traversals=16, top=5)["chain"]
    assert chain["added_ms"] == pytest.approx(0.48)
    links = {(i["after"], i["kernel"]): i for i in chain["items"]}
    assert list(links) == [
        ("decode_gemm", "decode_gemm"),  # 300 us
        ("sampler", "decode_gemm"),  # 100
        ("decode_gemm", "attention"),  # 80
    ]
    assert links[("decode_gemm", "attention")]["added_median_us"] == pytest.approx(80)
    assert links[("decode_gemm", "decode_gemm")]["added_share"] == pytest.approx(300 / 480)
    assert (
        analyze(gpu_trace(), token_steps=4, traversals=16, top=1)["chain"]["items"][0]["calls"] == 1
    )


def traversals_trace(traversals: int, layers: int) -> dict[str, Any]:
    """One decode window of back-to-back kernels (each adds its duration): per traversal a
    prepare (5 us), then per layer a GEMM (10 us, the first after the prepare) and a norm
    (2 us), then the lm_head (1 us) and advance (3 us); after the window a sampler (50 us)."""
    t, events = 10.0, [mark("rlt.workload", 0, 10_000), mark("rlt.step", 0, 9_000)]
    events.append(mark("rlt.decode_window", 5, 8_000))
    plan = []
    for _ in range(traversals):
        plan += [("prepare", [1, 1, 1], 5.0)]
        plan += [("gemm", [96, 1, 1], 10.0), ("norm", [8, 1, 1], 2.0)] * layers
        plan += [("lm_head", [768, 1, 1], 1.0), ("advance", [1, 1, 1], 3.0)]
    for corr, (name, grid, dur) in enumerate([*plan, ("sampler", [1, 1, 1], 50.0)], 1):
        at = 6.0 if name != "sampler" else 8_500.0  # launched in the window, or after it
        events.append(launch(at, corr))
        events.append({**kernel(name, t, dur, corr), "args": {"correlation": corr, "grid": grid}})
        t += dur
    return {"traceEvents": events}


def test_the_chain_cadence_spreads_each_link_over_its_runs() -> None:
    """A layer run's added time is every link whose kernel runs about once a layer run (the
    first layer's GEMM after the prepare included), a traversal's own launches those of about
    once a traversal, the rest is the windows' (the sampler launched after it is not)."""
    chain = analyze(traversals_trace(4, 3), token_steps=1, traversals=4, layers=3)["chain"]
    cadence = chain["cadence"]
    assert cadence["layer_runs"] == 12
    assert cadence["layer_us"] == pytest.approx(12.0)  # GEMM 10 + norm 2
    assert cadence["traversal_us"] == pytest.approx(9.0)  # prepare 5 + lm_head 1 + advance 3
    assert cadence["other_ms"] == pytest.approx(0.0)
    assert chain["added_ms"] == pytest.approx((12 * 12 + 4 * 9) / 1e3)
    assert analyze(traversals_trace(4, 3), token_steps=1, traversals=4)["chain"]["cadence"] is None


def test_cpu_trace_has_no_gpu_numbers_and_ranks_cpu_ops_by_self_time() -> None:
    op = {"ph": "X", "cat": "cpu_op", **MAIN}
    trace = {
        "traceEvents": [
            mark("rlt.workload", 0, 100),
            mark("rlt.step", 0, 90),
            mark("rlt.decode_window", 10, 60),
            {**op, "name": "aten::linear", "ts": 10, "dur": 50},
            {**op, "name": "aten::mm", "ts": 15, "dur": 40},
            {**op, "name": "aten::add", "ts": 60, "dur": 5},
        ]
    }
    s = analyze(trace, token_steps=1, traversals=4)
    assert s["gpu"]["available"] is False and s["gpu"]["busy_share_decode_window"] is None
    assert s["chain"] is None
    assert all(p["gpu_ms"] is None for p in s["phases"])
    top = s["top"]
    assert top["kind"] == "cpu_ops"
    assert [(k["name"], k["total_ms"]) for k in top["items"]] == [
        ("aten::mm", pytest.approx(0.04)),
        ("aten::linear", pytest.approx(0.01)),
        ("aten::add", pytest.approx(0.005)),
    ]


def test_a_trace_without_the_workload_marker_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rlt\.workload"):
        analyze({"traceEvents": [mark("rlt.step", 0, 1)]}, token_steps=1, traversals=1)


def test_load_trace_reads_plain_and_gzipped(tmp_path: Path) -> None:
    trace = gpu_trace()
    (tmp_path / "t.json").write_text(json.dumps(trace))
    with gzip.open(tmp_path / "t.json.gz", "wt") as f:
        json.dump(trace, f)
    assert load_trace(tmp_path / "t.json") == load_trace(tmp_path / "t.json.gz") == trace
