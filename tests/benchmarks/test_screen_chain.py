"""benchmarks/screen_chain.py's variants: parsing, which rows apply, and that each is undone."""

from __future__ import annotations

import json

import benchmark_scripts
import pytest
from decode_forms import decode_forms

pytest.importorskip("triton")

from rlt_engine.kernels import paged_attention

O8 = "2048x2048:m8:bfloat16"
ROW = '("ws", 64, 256, 2, 4, 3, 0, 0)'


@pytest.fixture(scope="module")
def screen():
    return benchmark_scripts.load("screen_chain")


def test_a_variant_takes_table_rows_and_module_constants(screen):
    v = screen.parse_variant(f"o2; {O8}={ROW}; kernels.paged_attention.WIDE_TILE_SEQS=4")
    assert v.name == "o2"
    assert v.rows == [(O8, ("ws", 64, 256, 2, 4, 3, 0, 0))]
    assert v.sets == [("kernels.paged_attention", "WIDE_TILE_SEQS", 4)]


@pytest.mark.parametrize(
    "text",
    ["o2", f"base;{O8}={ROW}", f";{O8}={ROW}", f"o2=1;{O8}={ROW}", f"o2;{O8}=(1", "o2;X=1"],
)
def test_a_malformed_variant_is_refused(screen, text):
    with pytest.raises(ValueError):
        screen.parse_variant(text)


def test_a_row_no_gemm_of_the_chain_looks_up_is_an_error(screen):
    ouro = screen.MODELS["ouro"]
    assert screen.chain_keys(ouro, 8) == {
        "6144x2048:m8:bfloat16",
        O8,
        "11264x2048:m8:bfloat16",
        "2048x5632:m8:bfloat16",
    }
    one_row = screen.parse_variant(f"o1;2048x2048:m1:bfloat16={ROW}")
    screen.check_rows([one_row], ouro, [1, 8])
    with pytest.raises(ValueError, match="--rows 8"):
        screen.check_rows([one_row], ouro, [8])
    # Nanbeige's shapes are not Ouro's
    with pytest.raises(ValueError, match="2048x2048:m8"):
        screen.check_rows([screen.parse_variant(f"o;{O8}={ROW}")], screen.MODELS["nanbeige"], [8])
    # a variant with no row for these rows is skipped there, unless it sets a constant
    assert not screen.applies(one_row, screen.chain_keys(ouro, 8))
    sets_only = screen.parse_variant("w;kernels.paged_attention.WIDE_TILE_SEQS=4")
    assert screen.applies(sets_only, screen.chain_keys(ouro, 8))


def test_applied_rows_and_constants_are_undone_even_after_an_error(screen):
    entries = {O8: ("ws", 64, 256, 4, 4, 2, 4.39, 6.33)}
    before = paged_attention.WIDE_TILE_SEQS
    v = screen.parse_variant(f"v;{O8}={ROW};kernels.paged_attention.WIDE_TILE_SEQS=9")
    with screen.Applied(v, entries):
        assert entries[O8] == ("ws", 64, 256, 2, 4, 3, 0, 0)
        assert paged_attention.WIDE_TILE_SEQS == 9
    assert entries[O8] == ("ws", 64, 256, 4, 4, 2, 4.39, 6.33)
    assert before == paged_attention.WIDE_TILE_SEQS
    # the constant is set before the table is found to lack the row: both left as they were
    bad = screen.parse_variant(
        f"bad;kernels.paged_attention.WIDE_TILE_SEQS=9;2048x2048:m4:bfloat16={ROW}"
    )
    with (
        pytest.raises(ValueError, match="the table has no 2048x2048:m4"),
        screen.Applied(bad, entries),
    ):
        pass
    assert before == paged_attention.WIDE_TILE_SEQS
    assert list(entries) == [O8]
    no_such = screen.parse_variant("n;kernels.paged_attention.NO_SUCH=1")
    with pytest.raises(ValueError, match="has no NO_SUCH"), screen.Applied(no_such, entries):
        pass


def test_rounds_rotate_and_changes_are_against_base(screen):
    assert screen.rotated(["base", "a", "b"], 0) == ["base", "a", "b"]
    assert screen.rotated(["base", "a", "b"], 4) == ["a", "b", "base"]
    out = screen.summarize({"base": [400.0, 404.0, 408.0], "a": [392.0, 396.0, 380.0]}, 8)
    assert out["base"]["us_per_layer"] == 50.5
    assert out["base"]["change_pct"] == 0.0
    assert out["a"]["us_per_layer"] == 49.0
    assert out["a"]["change_pct"] == pytest.approx(100 * (49.0 / 50.5 - 1))
    assert out["a"]["rounds"] == [49.0, 49.5, 47.5]


def _result(rows, changes):
    variants = {"base": {"change_pct": 0.0}}
    variants.update({name: {"change_pct": c} for name, c in changes.items()})
    return {"rows": rows, "variants": variants}


def test_winners_are_the_variants_that_shorten_the_layer_enough_best_first(screen):
    results = [_result(1, {"a": -0.2, "b": 0.4, "c": -0.6}), _result(8, {"a": -1.5, "b": -0.4})]
    # a variant skipped at a row count (c at 8 rows) keeps its change at the others
    assert screen.winners(results, 0.5) == [("a", -1.5), ("c", -0.6)]
    assert screen.winners(results, 0.0) == [("a", -1.5), ("c", -0.6), ("b", -0.4)]
    assert screen.winners(results, 2.0) == []


def test_the_winners_argument_files_run_the_same_variant_in_ab_decode(screen, tmp_path):
    ab = benchmark_scripts.load("ab_decode")
    o2 = screen.parse_variant(f"o2;{O8}={ROW};kernels.paged_attention.WIDE_TILE_SEQS=4")
    wide = screen.parse_variant("wide;kernels.norm_chain.RELEASE_EARLY_ROWS={2048: 8}")
    slow = screen.parse_variant("slow;kernels.paged_attention.SHORT_SPLITS=8")
    results = [_result(1, {"wide": -0.7, "slow": 1.0}), _result(8, {"o2": -2.0, "wide": 0.1})]
    files = screen.write_ab_args(
        tmp_path / "args", [o2, wide, slow], results, [1, 8], 0.5, "nanbeige"
    )
    assert [f.name for f in files] == ["01-o2.args", "02-wide.args"]
    base = ab.parser().parse_args(["--out", str(tmp_path), f"@{tmp_path / 'args' / 'base.args'}"])
    assert (base.label, base.model, base.concurrency, base.sets, base.rows) == (
        "base",
        "nanbeige",
        "1,8",
        [],
        [],
    )
    args = ab.parser().parse_args(["--out", str(tmp_path), f"@{files[0]}"])
    assert (args.label, args.model) == ("o2", "nanbeige")
    assert args.concurrency == "1,8"
    assert args.sets == o2.sets
    assert args.rows == o2.rows
    args = ab.parser().parse_args(["--out", str(tmp_path), f"@{files[1]}"])
    assert (args.label, args.sets, args.rows) == ("wide", wide.sets, [])
    summary = json.loads((tmp_path / "args" / "winners.json").read_text())
    assert [w["name"] for w in summary["winners"]] == ["o2", "wide"]


@pytest.mark.parametrize("name", ["o 2", "o/2", "o,2", ""])
def test_a_variant_name_that_cannot_be_a_label_and_file_name_is_refused(screen, name):
    with pytest.raises(ValueError, match="NAME of letters"):
        screen.parse_variant(f"{name};kernels.paged_attention.WIDE_TILE_SEQS=4")


@pytest.mark.parametrize(
    "path",
    sorted((benchmark_scripts.ROOT / "benchmarks" / "variants").glob("*.args")),
    ids=lambda p: p.name,
)
def test_a_committed_variants_file_holds_rows_the_ws_kernel_takes_in_the_chain(screen, path):
    """benchmarks/variants/*.args (screen_then_ab.sh's VARIANTS_FILE): each row replaces one the
    table has, and the ws kernel takes it in the chain's form (the qkv with its RoPE epilogue,
    the gate/up with SwiGLU): a refused row would fall back to another route and screen that.
    Each constant names one its module has, set to a value of the type it has now."""
    import importlib

    from rlt_engine.kernels import ws_gemm
    from rlt_engine.kernels.small_gemm_tables import TABLES

    forms = decode_forms()
    args = screen.parser().parse_args(["--out", "unused", f"@{path}"])
    variants = args.variants
    assert variants and len({v.name for v in variants}) == len(variants)
    screen.check_rows(variants, screen.MODELS[args.model], args.rows)  # the file's own rows
    for variant in variants:
        for key, row in variant.rows:
            assert any(key in t["entries"] for t in TABLES), f"{variant.name}: no table has {key}"
            shape, bucket, _ = key.split(":")
            n, k = map(int, shape.split("x"))
            backend, block_n, block_k, split_k, _, stages, *_ = row
            assert backend == "ws"
            why = ws_gemm.check(
                n, k, int(bucket[1:]), block_n, block_k, split_k,
                swiglu=forms.get((n, k), {}).get("swiglu", False), stages=stages,
                rope="rope_d" in forms.get((n, k), {}),
            )  # fmt: skip
            assert why is None, f"{variant.name}: {why}"
        for module, attr, value in variant.sets:
            now = getattr(importlib.import_module(f"rlt_engine.{module}"), attr)
            assert type(value) is type(now), f"{variant.name}: {attr} is a {type(now).__name__}"


def test_a_variant_whose_output_is_not_base_s_is_wrong_and_never_a_winner(screen):
    import torch

    base = torch.linspace(-1.0, 1.0, 64).reshape(8, 8).bfloat16()
    rounded = base.clone()
    rounded[0, 0] += 2**-7  # another split-K order: an element an ulp or so off
    garbage = torch.zeros_like(base)  # a partial no program wrote
    nan = base.clone()
    nan[3, 3] = float("nan")
    errors = screen.output_errors({"base": base, "r": rounded, "g": garbage, "n": nan})
    assert errors["base"] == 0.0 and 0.0 < errors["r"] < 1e-2
    assert errors["g"] == pytest.approx(1.0) and errors["n"] == float("inf")
    times = {name: [400.0, 400.0, 400.0] for name in ("base", "r", "g", "n")}
    times["g"] = times["n"] = [200.0, 200.0, 200.0]  # "faster": they skip the work
    times["r"] = [392.0, 392.0, 392.0]
    out = screen.summarize(times, 8, errors)
    assert [name for name, v in out.items() if v["wrong"]] == ["g", "n"]
    assert out["r"]["output_rel_err"] == errors["r"]
    # wrong at one row count is wrong at all: only r wins
    other = screen.summarize({"base": [400.0], "g": [380.0], "n": [390.0], "r": [399.0]}, 8,
                             {"base": 0.0, "g": 0.0, "n": 0.0, "r": 0.0})  # fmt: skip
    assert screen.winners([{"variants": out}, {"variants": other}], 0.5) == [
        ("r", pytest.approx(-2.0))
    ]
