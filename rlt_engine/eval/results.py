"""One sweep setting (loop depth x exit threshold) and what it scored: accuracy per filter with a
95% Wilson score interval, mean loops per output token, output tokens per second."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (sensible at 0% and 100% too, unlike
    the normal approximation)."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass(frozen=True)
class Setting:
    """`max_loops` and `exit_threshold` of one sweep point; None = the model's default."""

    max_loops: int | None
    exit_threshold: float | None

    @property
    def label(self) -> str:
        loops = "default" if self.max_loops is None else str(self.max_loops)
        threshold = "default" if self.exit_threshold is None else f"{self.exit_threshold:g}"
        return f"loops={loops} exit={threshold}"

    @property
    def slug(self) -> str:
        """For file names: loops4-exit0.7, loopsdefault-exitdefault."""
        return self.label.replace("=", "").replace(" ", "-")

    def to_json(self) -> dict[str, Any]:
        return {"max_loops": self.max_loops, "exit_threshold": self.exit_threshold}


@dataclass
class SettingResult:
    """Running totals of one setting; `add` takes the per-question records."""

    setting: Setting
    total: int  # questions this setting evaluates
    filters: list[str]
    done: int = 0
    correct: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0
    depth_sum: int = 0  # sum of exit depths over the tokens that report one
    depth_tokens: int = 0
    run_tokens: int = 0  # tokens generated in this invocation (not resumed), for tokens/s
    started: float | None = None
    finished: float | None = None

    def start(self) -> None:
        self.started = time.perf_counter()

    def finish(self) -> None:
        self.finished = time.perf_counter()

    def add(self, record: dict[str, Any], *, resumed: bool = False) -> None:
        self.done += 1
        for name in self.filters:
            self.correct[name] = self.correct.get(name, 0) + bool(record["correct"][name])
        self.output_tokens += record["num_tokens"]
        depths = record.get("exit_depths")
        if depths:
            self.depth_sum += sum(depths)
            self.depth_tokens += len(depths)
        if not resumed:
            self.run_tokens += record["num_tokens"]

    def accuracy(self, name: str) -> float | None:
        return self.correct.get(name, 0) / self.done if self.done else None

    def interval(self, name: str) -> tuple[float, float]:
        return wilson_interval(self.correct.get(name, 0), self.done)

    @property
    def mean_loops(self) -> float | None:
        """Mean loops run per output token (from the exit depths); None without any."""
        return self.depth_sum / self.depth_tokens if self.depth_tokens else None

    @property
    def seconds(self) -> float | None:
        if self.started is None:
            return None
        return (self.finished or time.perf_counter()) - self.started

    @property
    def tokens_per_second(self) -> float | None:
        """Output tokens generated in this invocation per second of this setting's wall time."""
        seconds = self.seconds
        if not self.run_tokens or not seconds:
            return None
        return self.run_tokens / seconds

    def to_json(self) -> dict[str, Any]:
        accuracy = {}
        for name in self.filters:
            low, high = self.interval(name)
            accuracy[name] = {
                "accuracy": self.accuracy(name),
                "correct": self.correct.get(name, 0),
                "ci95": [low, high],
            }
        return {
            **self.setting.to_json(),
            "label": self.setting.label,
            "questions": self.done,
            "accuracy": accuracy,
            "output_tokens": self.output_tokens,
            "mean_loops_per_token": self.mean_loops,
            "output_tokens_per_s": self.tokens_per_second,
            "seconds": self.seconds,
        }
