"""benchmarks/bench_small_gemm.py's in-place confirmation (--confirm-in-place): which shapes it
measures, and which rows it keeps, against a decode rate given by a table of made-up speeds."""

from __future__ import annotations

import benchmark_scripts
import pytest

pytest.importorskip("triton")


def _module():  # type: ignore[no-untyped-def]
    return benchmark_scripts.load("bench_small_gemm")


OLD = {
    "64x32:m1:bfloat16": ("triton", 32, 32, 1, 4, 2, 5.0, 6.0),
    "64x32:m8:bfloat16": ("cublas", 32, 32, 1, 4, 2, 6.0, 6.0),
    "96x32:m1:bfloat16": ("triton", 32, 32, 2, 4, 2, 5.0, 6.0),
    "128x64:m1:bfloat16": ("triton", 64, 64, 1, 4, 2, 5.0, 6.0),
}
NEW = {
    "64x32:m1:bfloat16": ("ws", 64, 32, 1, 4, 3, 4.0, 6.0),  # changed: faster in place
    "64x32:m8:bfloat16": ("cublas", 32, 32, 1, 4, 2, 6.0, 6.0),
    "96x32:m1:bfloat16": ("ws", 64, 32, 1, 4, 2, 4.0, 6.0),  # changed: slower in place
    "96x32:m8:bfloat16": ("ws", 64, 32, 1, 4, 2, 4.0, 6.0),
    "128x64:m1:bfloat16": ("triton", 64, 64, 1, 4, 2, 5.0, 6.0),  # unchanged
}


def test_rows_of_a_shape_and_swapping_them():
    bench = _module()
    assert set(bench.shape_rows(NEW, 96, 32)) == {"96x32:m1:bfloat16", "96x32:m8:bfloat16"}
    swapped = bench.with_rows(NEW, OLD, 96, 32)
    assert bench.shape_rows(swapped, 96, 32) == bench.shape_rows(OLD, 96, 32)  # m8 row gone
    assert bench.shape_rows(swapped, 64, 32) == bench.shape_rows(NEW, 64, 32)


def test_keeps_new_rows_unless_the_old_ones_decode_faster():
    bench = _module()
    calls = []

    def rate(model, entries):  # tok/s: 100, +10 for ws on 64x32, -5 for ws on 96x32
        calls.append((model, dict(entries)))
        speed = 100.0
        speed += 10 * (entries.get("64x32:m1:bfloat16", ("",))[0] == "ws")
        speed -= 5 * (entries.get("96x32:m1:bfloat16", ("",))[0] == "ws")
        return {1: speed, 8: 8 * speed}

    shapes = {"model-a": [(64, 32), (96, 32), (128, 64)], "model-b": [(128, 64)]}
    entries, report = bench.confirm_in_place(OLD, NEW, shapes, rate)
    assert bench.shape_rows(entries, 64, 32) == bench.shape_rows(NEW, 64, 32)
    assert bench.shape_rows(entries, 96, 32) == bench.shape_rows(OLD, 96, 32)
    assert bench.shape_rows(entries, 128, 64) == bench.shape_rows(NEW, 128, 64)
    assert report["model-a"]["64x32"]["kept"] == "new"
    assert report["model-a"]["96x32"]["kept"] == "old"
    assert report["model-a"]["96x32"]["old_rows_speedup"] == pytest.approx(110 / 105)
    assert report["model-a"]["final"] == {1: 110.0, 8: 880.0}
    assert "model-b" not in report  # nothing of it changed: never decoded
    # new, then each changed shape reverted alone, then the result and the old table
    assert [m for m, _ in calls] == ["model-a"] * 5


def test_a_gain_within_the_margin_keeps_the_new_rows(monkeypatch):
    bench = _module()
    monkeypatch.setattr(bench, "IN_PLACE_MARGIN", 0.10)

    def rate(model, entries):  # the old rows of 96x32 gain 5%: within a 10% margin
        slow = entries.get("96x32:m1:bfloat16", ("",))[0] == "ws"
        return {1: 100.0 - 5 * slow}

    entries, report = bench.confirm_in_place(OLD, NEW, {"m": [(96, 32)]}, rate)
    assert entries == NEW and report["m"]["96x32"]["kept"] == "new"


def test_the_gate_up_is_tuned_as_the_model_runs_it():
    """The packed gate/up in its fused SwiGLU forms, the ungated GEMMs with the ws kernel, the
    gated lm_head on the Triton kernel only."""
    bench = _module()
    assert bench.form_of(["ouro-1.4b/gate_up"]) == "swiglu"
    assert bench.form_of(["ouro-1.4b/qkv", "nanbeige4.2-3b/o_proj"]) == "ws"
    assert bench.form_of(["ouro-1.4b/lm_head"]) == "plain"


def test_the_table_names_the_shapes_checked_in_decode(tmp_path):
    bench = _module()
    meta = {"device": "GPU", "triton": "3.6.0", "torch": "2.11"}
    bench.write_table(tmp_path / "plain.py", meta, NEW)
    assert "checked in decode" not in (tmp_path / "plain.py").read_text()
    report = {"m": {"new": {}, "64x32": {"kept": "new"}, "96x32": {"kept": "old"}, "final": {}}}
    bench.write_table(tmp_path / "checked.py", {**meta, "in_place": report}, NEW)
    text = (tmp_path / "checked.py").read_text()
    assert "checked in decode (--confirm-in-place): 64x32, 96x32." in text
    namespace: dict = {}
    exec(compile(text, "checked.py", "exec"), namespace)  # a module that imports as written
    assert namespace["TABLE"]["entries"] == NEW
