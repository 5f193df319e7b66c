"""`--plot FILE.png`: accuracy against mean loops per output token, one line per filter, with
95% Wilson intervals as error bars. matplotlib is the optional extra `rlt[plot]`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlt_engine.eval.results import SettingResult


class PlotError(ValueError):
    """No matplotlib, or a plot that cannot be written (one line for the user)."""


def require_matplotlib() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or a one-line PlotError."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError(
            "--plot needs matplotlib, which is not installed: pip install 'rlt[plot]' "
            "(or pip install matplotlib)"
        ) from None
    return plt


def write_plot(results: list[SettingResult], path: Path, title: str) -> Path:
    plt = require_matplotlib()
    points = [r for r in results if r.mean_loops is not None and r.done]
    if not points:
        raise PlotError("--plot: no setting reported exit depths, so there is no loops axis")
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, marker in zip(points[0].filters, "osD^v", strict=False):
        x = [r.mean_loops for r in points]
        y = [100 * (r.accuracy(name) or 0.0) for r in points]
        low = [yi - 100 * r.interval(name)[0] for yi, r in zip(y, points, strict=True)]
        high = [100 * r.interval(name)[1] - yi for yi, r in zip(y, points, strict=True)]
        axes.errorbar(x, y, yerr=[low, high], fmt=marker, capsize=3, alpha=0.8, label=name)
    for r in points:
        best = max(100 * (r.accuracy(n) or 0.0) for n in r.filters)
        axes.annotate(
            r.setting.label,
            (r.mean_loops, best),
            textcoords="offset points",
            xytext=(4, 6),
            fontsize=7,
        )
    axes.set_xlabel("mean loops per output token")
    axes.set_ylabel("accuracy (%)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path)
    except OSError as exc:
        raise PlotError(f"--plot {path}: {exc}") from None
    finally:
        plt.close(figure)
    return path
