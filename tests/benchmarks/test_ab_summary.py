"""benchmarks/ab_summary.py: an A/B call's rows as the results notes give them."""

from __future__ import annotations

import json

import benchmark_scripts
import pytest


@pytest.fixture(scope="module")
def ab_summary():
    return benchmark_scripts.load("ab_summary")


def _row(label, c1, c8, sha="aaaa1111bbbb2222", **more):
    return {"label": label, "c1": c1, "c1_runs": [c1], "c8": c8, "c8_runs": [c8],
            "tokens_sha": sha, "wall_s": 20.0, **more}  # fmt: skip


ROWS = [  # base new new base, as a call alternates them
    _row("base", 200.0, 1000.0),
    _row("new", 210.0, 990.0),
    _row("new", 214.0, 1010.0),
    _row("base", 202.0, 1002.0),
    _row("other", 100.0, 500.0, sha="cccc3333dddd4444"),
]


def test_changes_are_against_the_mean_of_the_base_runs(ab_summary):
    s = ab_summary.summarise(ROWS)
    assert s["base"] == "base" and s["columns"] == ["c1", "c8"]  # not the *_runs lists
    assert list(s["labels"]) == ["base", "new", "other"]  # in the order they first ran
    new = s["labels"]["new"]
    assert new["runs"] == {"c1": [210.0, 214.0], "c8": [990.0, 1010.0]}
    assert new["change"]["c1"] == pytest.approx(100 * (212 / 201 - 1))
    assert new["change"]["c8"] == pytest.approx(100 * (1000 / 1001 - 1))
    assert s["labels"]["base"]["change"] == {"c1": 0.0, "c8": 0.0}
    assert new["same_tokens"] and not s["labels"]["other"]["same_tokens"]


def test_another_base_and_a_column_not_every_row_has(ab_summary):
    rows = [*ROWS[:4], {**_row("long", 205.0, 1005.0), "c8_p150": 900.0}]
    s = ab_summary.summarise(rows, base="new")
    assert s["columns"] == ["c1", "c8"]  # c8_p150: one row only
    assert s["labels"]["base"]["change"]["c1"] == pytest.approx(100 * (201 / 212 - 1))
    with pytest.raises(SystemExit, match="no such label"):
        ab_summary.summarise(rows, base="missing")


def test_a_variant_run_at_fewer_concurrencies_keeps_the_bases_columns(ab_summary):
    """A variant that only matters at c=8 (run there alone) leaves c=1 empty for itself, not
    c=1 out of every label's row."""
    short = {k: v for k, v in _row("wide", 0.0, 980.0).items() if not k.startswith("c1")}
    s = ab_summary.summarise([*ROWS[:4], short, short])
    assert s["columns"] == ["c1", "c8"]
    wide = s["labels"]["wide"]
    assert wide["runs"] == {"c1": [], "c8": [980.0, 980.0]} and list(wide["change"]) == ["c8"]
    line = ab_summary.markdown(s).splitlines()[-1]
    assert line == "| wide |  | 980.0 / 980.0 (-2.1%) | aaaa1111 |"


def test_markdown_table_and_json_from_the_file(ab_summary, tmp_path, capsys):
    path = tmp_path / "ab.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    ab_summary.main([str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| variant | c=1 | c=8 | tokens |"
    assert lines[2] == "| base | 200.0 / 202.0 | 1,000.0 / 1,002.0 | aaaa1111 |"
    assert lines[3] == "| new | 210.0 / 214.0 (+5.5%) | 990.0 / 1,010.0 (-0.1%) | aaaa1111 |"
    assert lines[4].endswith("| cccc3333 (differ) |")
    ab_summary.main([str(path), "--json", "--base", "new"])
    assert json.loads(capsys.readouterr().out)["base"] == "new"
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SystemExit, match="no A/B rows"):
        ab_summary.main([str(tmp_path / "empty.jsonl")])
