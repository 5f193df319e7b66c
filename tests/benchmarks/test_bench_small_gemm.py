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
    assert report["model-a"]["64x32"]["kept"] == {"64x32:m1:bfloat16": "new"}
    assert report["model-a"]["96x32"]["kept"] == {
        "96x32:m1:bfloat16": "old",  # back to the old row
        "96x32:m8:bfloat16": "old",  # the old table has none: dropped
    }
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
    assert entries == NEW and set(report["m"]["96x32"]["kept"].values()) == {"new"}


def test_each_row_is_decided_at_the_batch_that_runs_it():
    """A shape's rows reverted together, each bucket kept or reverted by the rate at c = its
    bucket: the m1 row that loses at c = 1 goes back although the shape's mean gains, the m8
    row that gains at c = 8 stays."""
    bench = _module()
    old = {"96x32:m1:bfloat16": OLD["96x32:m1:bfloat16"],
           "96x32:m8:bfloat16": ("triton", 32, 32, 4, 4, 2, 5.0, 6.0)}  # fmt: skip

    def rate(model, entries):  # the new m1 row -2% at c=1, the new m8 row +5% at c=8
        return {1: 100.0 - 2 * (entries["96x32:m1:bfloat16"][0] == "ws"),
                8: 800.0 + 40 * (entries["96x32:m8:bfloat16"][0] == "ws")}  # fmt: skip

    entries, report = bench.confirm_in_place(old, NEW, {"m": [(96, 32)]}, rate)
    assert entries["96x32:m1:bfloat16"] == old["96x32:m1:bfloat16"]
    assert entries["96x32:m8:bfloat16"] == NEW["96x32:m8:bfloat16"]
    assert report["m"]["96x32"]["kept"] == {"96x32:m1:bfloat16": "old", "96x32:m8:bfloat16": "new"}
    assert report["m"]["96x32"]["old_rows_speedup"] < 1  # the mean alone would keep both


def test_a_bucket_the_final_table_decodes_slower_gets_its_old_rows_back():
    """Two shapes' new m1 rows where either one costs c = 1 2%: reverting one shape alone
    recovers nothing, so each stays; the final table against the old one sends both back. The
    m8 rows, which gain at c = 8, stay."""
    bench = _module()
    old = {"64x32:m1:bfloat16": OLD["64x32:m1:bfloat16"],
           "64x32:m8:bfloat16": ("triton", 32, 32, 2, 4, 2, 5.0, 6.0),
           "96x32:m1:bfloat16": OLD["96x32:m1:bfloat16"],
           "96x32:m8:bfloat16": ("triton", 32, 32, 4, 4, 2, 5.0, 6.0)}  # fmt: skip
    new = {key: ("ws", 64, 32, 1, 4, 3, 4.0, 6.0) for key in old}

    def rate(model, entries):
        either = any(entries[f"{n}x32:m1:bfloat16"][0] == "ws" for n in (64, 96))
        return {1: 100.0 - 2 * either, 8: 800.0 + 8 * (entries["64x32:m8:bfloat16"][0] == "ws")}

    entries, report = bench.confirm_in_place(old, new, {"m": [(64, 32), (96, 32)]}, rate)
    assert report["m"]["64x32"]["kept"]["64x32:m1:bfloat16"] == "new"  # nothing alone
    assert report["m"]["96x32"]["kept"]["96x32:m1:bfloat16"] == "new"
    assert report["m"]["buckets_back"] == [1]
    assert entries["64x32:m1:bfloat16"] == old["64x32:m1:bfloat16"]
    assert entries["96x32:m1:bfloat16"] == old["96x32:m1:bfloat16"]
    assert entries["64x32:m8:bfloat16"] == new["64x32:m8:bfloat16"]


def test_rows_that_differ_only_in_their_times_are_not_measured():
    bench = _module()
    retimed = {key: (*row[:6], row[6] + 1.0, row[7]) for key, row in OLD.items()}
    calls = []
    entries, report = bench.confirm_in_place(OLD, retimed, {"m": [(96, 32)]},
                                             lambda *a: calls.append(a) or {1: 1.0})  # fmt: skip
    assert entries == retimed and report == {} and calls == []


def test_the_gate_up_is_tuned_as_the_model_runs_it():
    """The packed gate/up in its fused SwiGLU forms, the ungated GEMMs with the ws kernel, the
    gated lm_head on the Triton kernel only."""
    bench = _module()
    assert bench.form_of(["ouro-1.4b/gate_up"]) == "swiglu"
    assert bench.form_of(["ouro-1.4b/qkv", "nanbeige4.2-3b/o_proj"]) == "ws"
    assert bench.form_of(["ouro-1.4b/lm_head"]) == "plain"


def test_rows_are_confirmed_in_place_at_their_own_batch():
    """Decode rows of M sequences are what a batch of M decodes: tuning a bucket's rows
    confirms them at c = M, each bucket tuned and no other."""
    bench = _module()
    assert bench.in_place_cs([1, 2, 4, 8, 16, 32, 64]) == (1, 2, 4, 8, 16, 32, 64)
    assert bench.in_place_cs([64, 32, 32]) == (32, 64)
    assert bench.in_place_cs([8]) == (8,)


def test_the_ws_kernel_is_offered_up_to_64_rows_where_it_fits(monkeypatch):
    """On a 132-SM Hopper the ws configs reach 64 rows on every Ouro GEMM (a window of the rows
    where its whole K range does not fit), each within a block's shared memory, the qkv's
    with the RoPE epilogue's exchange."""
    import torch

    from rlt_engine.kernels import ws_gemm

    bench = _module()
    monkeypatch.setattr(ws_gemm, "available", lambda device: True)
    props = type("Props", (), {"multi_processor_count": 132})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    shapes = bench.model_shapes()
    for name in ("qkv", "o_proj", "gate_up", "down_proj"):
        n, k = shapes[f"ouro-1.4b/{name}"]
        rope = name == "qkv"
        for m in (1, 8, 16, 32, 64):
            offered = [
                c for c in bench.candidates(n, k, m, bench.form_of([f"x/{name}"]), rope)
                if c.kernel == "ws"
            ]  # fmt: skip
            assert offered, (name, m)
            for c in offered:
                exchange = rope or ws_gemm.halves(name == "gate_up", c.block_n)
                need = ws_gemm.shared_bytes(
                    k, m, c.block_n, c.block_k, c.split_k, c.num_stages, exchange
                )
                assert need <= ws_gemm.SHARED_LIMIT, (name, m, c)


def test_the_table_names_the_shapes_checked_in_decode(tmp_path):
    bench = _module()
    meta = {"device": "GPU", "capability": "9.0", "sms": 132, "triton": "3.6.0", "torch": "2.11"}
    bench.write_table(tmp_path / "plain.py", meta, NEW)
    assert "checked in decode" not in (tmp_path / "plain.py").read_text()
    report = {"m": {"new": {}, "64x32": {"kept": "new"}, "96x32": {"kept": "old"}, "final": {}}}
    bench.write_table(tmp_path / "checked.py", {**meta, "in_place": report}, NEW)
    text = (tmp_path / "checked.py").read_text()
    assert "checked in decode (--confirm-in-place): 64x32, 96x32." in text
    ranked = {"m": {"64x32": {"tried": []}}}
    bench.write_table(tmp_path / "ranked.py", {**meta, "in_place_rank": ranked}, NEW)
    assert "ranked the configs of (--rank-in-place): 64x32." in (tmp_path / "ranked.py").read_text()
    namespace: dict = {}
    exec(compile(text, "checked.py", "exec"), namespace)  # a module that imports as written
    assert namespace["TABLE"]["entries"] == NEW


def test_merge_into_replaces_and_adds_rows_and_keeps_the_rest_of_the_module(tmp_path):
    """--merge-into: this run's rows go into another GPU's table module line by line (an H100
    updating the Hopper table it takes); its docstring and other rows stay as written."""
    bench = _module()
    meta = {"device": "GPU", "capability": "9.0", "sms": 132, "triton": "3.6.0", "torch": "2.11"}
    path = tmp_path / "table.py"
    bench.write_table(path, meta, OLD)
    path.write_text(path.read_text().replace("do not edit by hand", "rows set by hand: see A"))
    rows = {
        "64x32:m1:bfloat16": NEW["64x32:m1:bfloat16"],  # a new config
        "64x32:m8:bfloat16": OLD["64x32:m8:bfloat16"],  # as it was
        "96x32:m8:bfloat16": NEW["96x32:m8:bfloat16"],  # a bucket the table had not
    }
    assert bench.merge_rows(path, rows) == ["64x32:m1:bfloat16", "96x32:m8:bfloat16"]
    text = path.read_text()
    assert "rows set by hand: see A" in text
    namespace: dict = {}
    exec(compile(text, "table.py", "exec"), namespace)
    assert namespace["TABLE"]["entries"] == OLD | rows
    assert list(namespace["TABLE"]["entries"])[-1] == "96x32:m8:bfloat16"
    assert bench.merge_rows(path, rows) == []
    assert path.read_text() == text


def _ranked_results(n: int, k: int, tops: dict[int, list[tuple[tuple, float]]]) -> list[dict]:
    """tune()'s results for one shape: per M, its fastest configs alone (fields, us)."""
    keys = ("block_n", "block_k", "split_k", "num_warps", "num_stages", "kernel")

    def top(ranked):
        return [{"config": dict(zip(keys, c, strict=True)), "graph_us": us} for c, us in ranked]

    return [{"n": n, "k": k, "m": m, "top": top(ranked)} for m, ranked in tops.items()]


TUNED = {  # the shape's decode rows as tuned alone (the fastest at each M); m32 on cuBLAS
    "64x32:m1:bfloat16": ("ws", 64, 32, 4, 4, 2, 4.0, 6.0),
    "64x32:m8:bfloat16": ("ws", 64, 32, 4, 4, 2, 4.1, 6.0),
    "64x32:m32:bfloat16": ("cublas", 64, 32, 1, 4, 4, 6.5, 6.0),
}
FAST = (64, 32, 2, 4, 3, "ws")  # second alone, fastest in place
SLOW = (32, 32, 1, 4, 4, "triton")  # third alone, slower in place


def _rate(gain_fast: float, calls: list):
    def rate(model, entries):
        calls.append(dict(entries))
        row = entries["64x32:m8:bfloat16"]
        speed = 100.0 * (gain_fast if row[:6] == ("ws", 64, 32, 2, 4, 3) else 1.0)
        speed *= 0.97 if row[0] == "triton" else 1.0
        return {1: speed, 8: 8 * speed}

    return rate


def test_rank_in_place_takes_the_runner_up_that_decodes_faster_twice():
    bench = _module()
    results = _ranked_results(
        64, 32,
        {1: [((64, 32, 4, 4, 2, "ws"), 4.0), (FAST, 4.2)],
         8: [((64, 32, 4, 4, 2, "ws"), 4.1), (FAST, 4.3), (SLOW, 4.5)]},
    )  # fmt: skip
    calls: list = []
    entries, report = bench.rank_in_place(TUNED, results, {"m": [(64, 32)]}, _rate(1.02, calls), 3)
    # both decode rows take the config, with its own time alone at each M; cuBLAS's row stays
    assert entries["64x32:m1:bfloat16"] == ("ws", 64, 32, 2, 4, 3, 4.2, 6.0)
    assert entries["64x32:m8:bfloat16"] == ("ws", 64, 32, 2, 4, 3, 4.3, 6.0)
    assert entries["64x32:m32:bfloat16"] == TUNED["64x32:m32:bfloat16"]
    shape = report["m"]["64x32"]
    assert shape["chosen"]["split_k"] == 2 and len(shape["tried"]) == 2
    assert shape["tried"][0]["speedup"] == pytest.approx(1.02)
    # the tuned table, each runner-up, then the winner and the tuned table again
    assert len(calls) == 5 and calls[-1] == TUNED


def test_rank_in_place_keeps_the_tuned_rows_within_the_margin():
    bench = _module()
    results = _ranked_results(64, 32, {8: [((64, 32, 4, 4, 2, "ws"), 4.1), (FAST, 4.3)]})
    calls: list = []
    entries, report = bench.rank_in_place(TUNED, results, {"m": [(64, 32)]}, _rate(1.004, calls), 2)
    assert entries == TUNED and "chosen" not in report["m"]["64x32"]
    assert len(calls) == 2  # no second measurement below the margin
