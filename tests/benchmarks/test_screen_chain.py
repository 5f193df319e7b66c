"""benchmarks/screen_chain.py's variants: parsing, which rows apply, and that each is undone."""

from __future__ import annotations

import benchmark_scripts
import pytest

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
