"""The reports: the live view's table, the final table and Markdown, the `--json` summary, and
the plot (through a stand-in pyplot, so the test needs no matplotlib)."""

from __future__ import annotations

import io
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from rlt_engine.eval.plot import PlotError, write_plot
from rlt_engine.eval.report import LiveView, final_table, markdown_table, summary
from rlt_engine.eval.results import Setting, SettingResult

FILTERS = ["strict-match", "flexible-extract"]


def results() -> list[SettingResult]:
    out = []
    for loops, depths in ((2, [4, 2, 2]), (4, [4, 4, 4])):
        result = SettingResult(Setting(loops, 1.0), 4, FILTERS)
        result.start()
        for i in range(2):
            correct = {"strict-match": i == 0, "flexible-extract": True}
            result.add({"correct": correct, "num_tokens": 3, "exit_depths": depths})
        result.finish()
        out.append(result)
    return out


def render(renderable: Any, width: int = 120) -> str:
    console = Console(file=io.StringIO(), width=width, record=True)
    console.print(renderable)
    return console.export_text()


def test_live_view_table_shows_progress_accuracy_and_speed() -> None:
    view = LiveView(results(), Console(file=io.StringIO()), "gsm8k_cot, 3-shot")
    view.started(1)
    text = render(view.render())
    assert "gsm8k_cot, 3-shot" in text
    assert "loops=2 exit=1" in text and "2/4" in text
    assert "50.0%" in text and "100.0%" in text and "2.67" in text and "4.00" in text


def test_live_view_off_a_terminal_prints_a_line_per_setting() -> None:
    out = io.StringIO()
    rs = results()
    with LiveView(rs, Console(file=out, width=200), "t") as view:
        view.started(0)
        view.finished(0)
    assert out.getvalue().startswith("loops=2 exit=1: 2/4 questions, strict-match 50.0%, ")
    silent = io.StringIO()
    with LiveView(rs, Console(file=silent), "t", enabled=False) as view:
        view.finished(0)
    assert silent.getvalue() == ""


def test_live_view_on_a_terminal_is_transient() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with LiveView(results(), console, "t") as view:
        view.started(0)
        view.updated(0)
    assert "loops=2 exit=1" in out.getvalue()


def test_final_table_markdown_and_summary() -> None:
    rs = results()
    text = render(final_table(rs, "caption here"))
    assert "50.0% [9.5, 90.5]" in text and "caption here" in text
    md = markdown_table(rs)
    assert md.splitlines()[0].startswith("| setting | n | strict-match [95% CI] |")
    assert "| loops=4 exit=1 | 2 | 50.0% [9.5, 90.5] | 100.0% [34.2, 100.0] | 4.00 |" in md
    data = summary(rs, {"task": "gsm8k_cot"})
    assert data["task"] == "gsm8k_cot" and data["interval"] == "95% Wilson score interval"
    assert data["settings"][0]["mean_loops_per_token"] == pytest.approx(8 / 3)


class _Axes:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def test_plot_points_and_error_bars(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    axes = _Axes()

    class Figure:
        def tight_layout(self) -> None:
            pass

        def savefig(self, path: Path) -> None:
            Path(path).write_bytes(b"\x89PNG")

    pyplot = types.ModuleType("matplotlib.pyplot")
    pyplot.subplots = lambda **kwargs: (Figure(), axes)  # type: ignore[attr-defined]
    pyplot.close = lambda figure: None  # type: ignore[attr-defined]
    matplotlib = types.ModuleType("matplotlib")
    matplotlib.use = lambda backend: None  # type: ignore[attr-defined]
    matplotlib.pyplot = pyplot  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)

    path = write_plot(results(), tmp_path / "plots" / "sweep.png", "title")
    assert path.read_bytes() == b"\x89PNG"
    bars = [c for c in axes.calls if c[0] == "errorbar"]
    assert [c[2]["label"] for c in bars] == FILTERS
    x, y = bars[0][1]
    assert x == [pytest.approx(8 / 3), 4.0] and y == [50.0, 50.0]
    labels = [c[1][0] for c in axes.calls if c[0] == "annotate"]
    assert labels == ["loops=2 exit=1", "loops=4 exit=1"]

    no_depths = SettingResult(Setting(None, None), 1, FILTERS)
    no_depths.add({"correct": dict.fromkeys(FILTERS, True), "num_tokens": 1, "exit_depths": None})
    with pytest.raises(PlotError, match="no setting reported exit depths"):
        write_plot([no_depths], tmp_path / "x.png", "title")


def test_plot_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotError, match=r"pip install 'rlt\[plot\]'"):
        write_plot(results(), tmp_path / "x.png", "title")
