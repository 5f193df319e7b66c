"""Route huggingface_hub's tqdm progress bars to one rich `Progress` display."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.filesize import decimal
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from tqdm.std import tqdm


class _NullWriter:
    """tqdm keeps counting while it renders here; rich does the drawing."""

    def write(self, _text: str) -> int:
        return 0

    def flush(self) -> None:
        pass


class _SilentTqdm(tqdm):
    """Counts like tqdm and draws nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)  # huggingface_hub's own tqdm takes a group name
        kwargs.update(disable=True)
        super().__init__(*args, **kwargs)


def rich_tqdm_class(progress: Progress) -> type[tqdm]:
    """A tqdm subclass whose every bar is mirrored as a task of `progress` (thread-safe)."""

    class RichTqdm(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)  # huggingface_hub's own tqdm takes a group name
            kwargs.update(file=_NullWriter(), disable=False)
            self._task: Any = None
            super().__init__(*args, **kwargs)
            self._task = progress.add_task(self._label(), total=None, amount="")
            self._sync()

        def _label(self) -> str:
            return (self.desc or "").rstrip(": ") or "Downloading"

        def _amount(self) -> str:
            n, total = self.n, self.total or 0
            if self.unit == "B":
                return f"{decimal(int(n))}/{decimal(int(total))}" if total else decimal(int(n))
            return f"{n:g}/{total:g} {self.unit}" if total else f"{n:g} {self.unit}"

        def _sync(self) -> None:
            if self._task is None:
                return
            progress.update(
                self._task,
                description=self._label(),
                total=self.total or None,
                completed=self.n,
                amount=self._amount(),
            )

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            self._sync()
            return shown

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            super().refresh(*args, **kwargs)
            self._sync()

        def close(self) -> None:
            super().close()
            self._sync()

    return RichTqdm


@contextmanager
def download_progress(console: Console, *, enabled: bool) -> Iterator[type[tqdm] | None]:
    """A live rich display for a download; yields the tqdm class to hand to huggingface_hub."""
    if not enabled:  # None would give huggingface_hub's own bars, drawn on stderr anyway
        yield _SilentTqdm
        return
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[amount]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        yield rich_tqdm_class(progress)
