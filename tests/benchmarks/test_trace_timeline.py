"""benchmarks/trace_timeline.py on a synthetic trace: traversals split at the prepare kernel,
idle gaps attributed to the kernels around them, the window boundary found."""

from __future__ import annotations

import json

from benchmark_scripts import load

tl = load("trace_timeline")

# (name, duration, idle us before the next event)
TRAVERSAL = [
    ("_prepare_kernel", 3.0, 0.0),
    ("ws_gemm_kernel", 8.0, 0.0),
    ("_paged_attention_kernel", 4.0, 0.0),
    ("_add_rms_norm_kernel", 2.0, 0.1),  # below the idle threshold
    ("_exit_rule_kernel", 2.0, 0.0),
    ("_small_gemm_kernel", 2.0, 1.0),
    ("_advance_kernel", 3.0, 2.5),  # the graph boundary
]


def _trace(windows: int = 2, per_window: int = 4) -> dict:
    events, t = [], 100.0
    for w in range(windows):
        for _ in range(per_window):
            for name, dur, gap in TRAVERSAL:
                events.append({"cat": "kernel", "name": name, "ts": t, "dur": dur})
                t += dur + gap
        if w < windows - 1:  # the read back, then the host issues the next window late
            events.append({"cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": t, "dur": 2.0})
            t += 2.0 + 10.0
    events.append({"cat": "cpu_op", "name": "aten::add_", "ts": 0.0, "dur": 5.0})  # not GPU
    return {"traceEvents": events}


def test_the_summary_finds_the_tail_gaps_and_the_window_boundary(tmp_path, capsys):
    s = tl.summarize(tl.gpu_events(_trace()))
    assert s["events"] == 2 * 4 * len(TRAVERSAL) + 1
    assert s["traversals"] == 8 and s["steady_traversals"] == 7
    gaps = {g["between"]: (g["us"], g["count"]) for g in s["idle_inside_traversals"]}
    assert gaps["_small_gemm_kernel -> _advance_kernel"] == (7.0, 7)
    assert gaps["_advance_kernel -> _prepare_kernel"] == (2.5 * 6, 6)
    assert gaps["Memcpy DtoH -> _prepare_kernel"] == (10.0, 1)
    assert not any(k.startswith("_add_rms_norm") for k in gaps)  # 0.1 us: noise
    big = s["big_gaps"]
    assert big["count"] == 8 and big["largest"][0]["us"] == 10.0
    outside = [row[3] for row in s["outside_the_layer_stack"]]
    assert outside == [
        "_prepare_kernel", "_exit_rule_kernel", "_small_gemm_kernel", "_advance_kernel",
        "_prepare_kernel",
    ]  # fmt: skip
    assert any("Memcpy" in row[3] for row in s["window_boundary"])

    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace()))
    tl.main([str(path), "--out", str(tmp_path / "report.txt")])
    text = capsys.readouterr().out
    assert "steady traversals 7" in text and "Memcpy DtoH -> _prepare_kernel" in text
    assert (tmp_path / "report.txt").read_text() == text
    tl.main([str(path), "--json"])
    assert json.loads(capsys.readouterr().out)["traversals"] == 8


def test_an_empty_trace_reports_nothing():
    s = tl.summarize([])
    assert s["traversals"] == 0 and s["traversal_us"] == {} and s["big_gaps"]["count"] == 0
    assert "0 GPU events" in tl.render(s)
