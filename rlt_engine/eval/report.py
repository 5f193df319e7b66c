"""What a person sees: a rich live view while the sweep runs (progress, running accuracy and
tokens/s per setting), then a final table; `--json` gets the same numbers as one object."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from rlt_engine.eval.results import SettingResult

INTERVAL = "95% Wilson score interval"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _accuracy_cell(result: SettingResult, name: str, interval: bool) -> str:
    accuracy = result.accuracy(name)
    if accuracy is None:
        return "-"
    if not interval:
        return _percent(accuracy)
    low, high = result.interval(name)
    return f"{100 * accuracy:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"


class LiveView:
    """The sweep's progress on a terminal (refreshed a few times a second). Off a terminal it
    prints one line per finished setting instead; `enabled=False` prints nothing."""

    def __init__(
        self, results: list[SettingResult], console: Console, title: str, enabled: bool = True
    ) -> None:
        self.results, self.console, self.title, self.enabled = results, console, title, enabled
        self.current: int | None = None
        self._live: Live | None = None

    def __enter__(self) -> LiveView:
        if self.enabled and self.console.is_terminal:
            self._live = Live(
                console=self.console,
                get_renderable=self.render,
                refresh_per_second=4,
                transient=True,
            )
            self._live.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def started(self, index: int) -> None:
        self.current = index

    def updated(self, index: int) -> None:
        pass  # the live view pulls the numbers when it refreshes

    def finished(self, index: int) -> None:
        if self.enabled and self._live is None:
            result = self.results[index]
            accuracy = ", ".join(f"{n} {_percent(result.accuracy(n))}" for n in result.filters)
            self.console.print(
                f"{result.setting.label}: {result.done}/{result.total} questions, {accuracy}, "
                f"{_number(result.mean_loops)} loops/token, "
                f"{_number(result.tokens_per_second, 1)} tok/s"
            )

    def render(self) -> RenderableType:
        table = Table(box=None, pad_edge=False, title=self.title, title_justify="left")
        table.add_column("setting")
        table.add_column("progress")
        table.add_column("done", justify="right")
        for name in self.results[0].filters if self.results else []:
            table.add_column(name, justify="right")
        table.add_column("loops/token", justify="right")
        table.add_column("tok/s", justify="right")
        for k, result in enumerate(self.results):
            style = "bold" if k == self.current else ("dim" if result.started is None else "")
            bar = ProgressBar(total=max(result.total, 1), completed=result.done, width=24)
            table.add_row(
                Text(result.setting.label, style=style),
                bar,
                f"{result.done}/{result.total}",
                *[_accuracy_cell(result, n, interval=False) for n in result.filters],
                _number(result.mean_loops),
                _number(result.tokens_per_second, 1),
            )
        return Group(table)


def final_table(results: list[SettingResult], caption: str) -> Table:
    table = Table(caption=caption, caption_justify="left", box=None, pad_edge=False)
    table.add_column("setting")
    table.add_column("n", justify="right")
    for name in results[0].filters if results else []:
        table.add_column(f"{name}\n[95% CI]", justify="right", no_wrap=True)
    table.add_column("loops/\ntoken", justify="right")
    table.add_column("output\ntok/s", justify="right")
    for result in results:
        table.add_row(
            result.setting.label,
            str(result.done),
            *[_accuracy_cell(result, n, interval=True) for n in result.filters],
            _number(result.mean_loops),
            _number(result.tokens_per_second, 1),
        )
    return table


def summary(results: list[SettingResult], meta: dict[str, Any]) -> dict[str, Any]:
    """The `--json` object: the run's description, then one entry per setting."""
    return {**meta, "interval": INTERVAL, "settings": [r.to_json() for r in results]}


def markdown_table(results: list[SettingResult]) -> str:
    """The final table as Markdown (for benchmark records)."""
    filters = results[0].filters if results else []
    head = ["setting", "n", *[f"{n} [95% CI]" for n in filters], "loops/token", "output tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r.setting.label, str(r.done)]
        cells += [_accuracy_cell(r, n, interval=True) for n in filters]
        cells += [_number(r.mean_loops), _number(r.tokens_per_second, 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
