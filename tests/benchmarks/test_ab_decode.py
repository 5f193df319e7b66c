"""benchmarks/ab_decode.py: its arguments, and that it measures the tree it is given (or
refuses), with the constants it is told to set."""

from __future__ import annotations

import benchmark_scripts
import pytest

import rlt_engine
from rlt_engine.kernels import paged_attention


@pytest.fixture(scope="module")
def ab():
    return benchmark_scripts.load("ab_decode")


def test_set_takes_a_module_a_name_and_a_literal(ab):
    assert ab.parse_set("kernels.paged_attention.SHORT_SPLITS=8") == (
        "kernels.paged_attention",
        "SHORT_SPLITS",
        8,
    )
    assert ab.parse_set("worker.x.FLAG=False")[2] is False
    for bad in ("SHORT_SPLITS=8", "kernels.paged_attention.SHORT_SPLITS", "a.B=eight"):
        with pytest.raises(ValueError, match="--set"):
            ab.parse_set(bad)


def test_long_takes_concurrency_and_prompt_length(ab):
    assert ab.parse_long("2:960") == (2, 960)
    for bad in ("960", "0:960", "2:", "a:1"):
        with pytest.raises(ValueError, match="--long"):
            ab.parse_long(bad)


def test_engine_takes_a_keyword_and_a_literal(ab):
    assert ab.parse_engine("incremental_kv=False") == ("incremental_kv", False)
    assert ab.parse_engine("max_num_batched_tokens=4096") == ("max_num_batched_tokens", 4096)
    for bad in ("incremental_kv", "incremental_kv=no", "a-b=1", "=1"):
        with pytest.raises(ValueError, match="--engine"):
            ab.parse_engine(bad)


def test_the_engine_has_a_slot_for_every_sequence_asked(ab):
    assert ab.slots_for([1, 8], []) == 8
    assert ab.slots_for([1], [(2, 960)]) == 8
    assert ab.slots_for([1, 8], [(64, 448), (16, 960)]) == 64
    assert ab.slots_for([256], []) == 256


def test_the_tree_is_the_one_imported_or_refused(ab, tmp_path):
    here = ab.use_tree(ab.ROOT)
    assert here == ab.ROOT.resolve() / "rlt_engine"
    with pytest.raises(ValueError, match="no rlt_engine package"):
        ab.use_tree(tmp_path)
    (tmp_path / "rlt_engine").mkdir()
    (tmp_path / "rlt_engine" / "__init__.py").write_text("")
    with pytest.raises(ValueError, match="already imported"):  # this process has the checkout's
        ab.use_tree(tmp_path)
    assert rlt_engine.__file__.startswith(str(ab.ROOT.resolve()))


def test_sets_apply_to_the_module_and_refuse_unknown_names(ab, monkeypatch):
    monkeypatch.setattr(paged_attention, "SHORT_SPLITS", paged_attention.SHORT_SPLITS)
    ab.apply_sets([("kernels.paged_attention", "SHORT_SPLITS", 8)])
    assert paged_attention.SHORT_SPLITS == 8
    assert paged_attention.decode_splits(1, True) == 8
    with pytest.raises(ValueError, match=r"has no SHORT_SPLIT$"):
        ab.apply_sets([("kernels.paged_attention", "SHORT_SPLIT", 8)])


def test_rows_replace_a_table_row_and_refuse_unknown_keys(ab):
    from rlt_engine.kernels.small_gemm_tables import table_of

    key = "11264x2048:m1:bfloat16"
    row = ("ws", 128, 128, 1, 4, 3, 0.0, 0.0)
    assert ab.parse_row(f"{key}={row!r}") == (key, row)
    for bad in (key, f"{key}=ws", "11264x2048=(1,)", f"{key}=[1, 2]"):
        with pytest.raises(ValueError, match="--row"):
            ab.parse_row(bad)
    entries = dict(table_of("NVIDIA H200")["entries"])
    ab.apply_rows([(key, row)], entries)
    assert entries[key] == row
    with pytest.raises(ValueError, match="has no 1x1:m1:bfloat16"):
        ab.apply_rows([("1x1:m1:bfloat16", row)], entries)
    with pytest.raises(ValueError, match="8 fields, got 2"):
        ab.apply_rows([(key, ("ws", 1))], entries)
    with pytest.raises(ValueError, match="no small-GEMM table serves"):
        ab.apply_rows([(key, row)], None)
    ab.apply_rows([], None)  # nothing asked: no table needed


def test_rows_come_from_a_file_of_arguments(ab, tmp_path):
    """`@FILE` stands for its lines: the `--row=KEY=ROW` lines a tuner's rows are kept in, beside
    rows given on the command line."""
    rows = tmp_path / "rows.txt"
    rows.write_text(
        "--row=6144x2048:m16:bfloat16=('ws', 64, 256, 1, 4, 5, 10.26, 12.75)\n"
        "--row=2048x5632:m2:bfloat16=('ws', 64, 128, 4, 4, 8, 10.3, 13.61)\n"
    )
    args = ab.parser().parse_args(
        ["--out", "o", "--label", "l", f"@{rows}", "--row", "1x1:m1:bfloat16=('ws', 1)"]
    )
    assert [key for key, _ in args.rows] == [
        "6144x2048:m16:bfloat16", "2048x5632:m2:bfloat16", "1x1:m1:bfloat16"
    ]  # fmt: skip
    assert args.rows[1][1] == ("ws", 64, 128, 4, 4, 8, 10.3, 13.61)
