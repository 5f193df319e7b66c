"""The `--output-dir` layout: `run.json` (what the run evaluates) and one JSONL per setting with
one record per question, appended and flushed as each answer arrives, so an interrupted run
loses nothing it finished and `--resume` continues where it stopped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

MANIFEST = "run.json"


class RecordsError(ValueError):
    """An output directory that cannot be used (one line for the user)."""


def check_output_dir(
    directory: Path, manifest: dict[str, Any], files: list[Path], resume: bool
) -> None:
    """Create `directory`, refuse to mix runs: without `resume` nothing may be there yet; with
    it, the earlier run must have evaluated the same things (`manifest`)."""
    path = directory / MANIFEST
    if not resume:
        taken = [p.name for p in [path, *files] if p.exists()]
        if taken:
            raise RecordsError(
                f"--output-dir {directory} already holds {taken[0]}: pass --resume to continue "
                "that run, or choose another directory"
            )
    elif path.exists():
        try:
            earlier = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise RecordsError(f"--resume: cannot read {path} ({exc})") from None
        for key, value in manifest.items():
            if earlier.get(key) != value:
                raise RecordsError(
                    f"--resume: {path} was written with {key}={earlier.get(key)!r}, this run "
                    f"has {key}={value!r}"
                )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise RecordsError(f"--output-dir {directory}: {exc}") from None


def read_records(path: Path, prompts: list[str]) -> dict[int, dict[str, Any]]:
    """The finished questions of one setting's JSONL, by question index. A partial last line
    (the run was killed mid-write) is dropped; a record whose prompt is not this run's is an
    error (the data or the prompts changed)."""
    if not path.exists():
        return {}
    records: dict[int, dict[str, Any]] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # cut short by an interruption: that question runs again
            raise RecordsError(f"--resume: {path} line {number} is not valid JSON") from None
        index = record.get("index")
        if not isinstance(index, int) or not 0 <= index < len(prompts):
            continue  # a question beyond this run's --limit
        if record.get("prompt") != prompts[index]:
            raise RecordsError(
                f"--resume: {path} line {number} has another prompt for question {index} "
                "(different data, task or few-shot settings)"
            )
        records[index] = record
    return records


class RecordWriter:
    """Appends records to one setting's JSONL, one flushed line each."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self._file = self._open()
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()

    def _open(self) -> IO[str]:
        try:
            text = self.path.read_text(encoding="utf-8") if self.path.exists() else ""
            # a partial last line from an interrupted run would glue onto the next record
            keep = text if not text or text.endswith("\n") else text[: text.rfind("\n") + 1]
            if keep != text:
                self.path.write_text(keep, encoding="utf-8")
            return self.path.open("a", encoding="utf-8")
        except OSError as exc:
            raise RecordsError(f"cannot write {self.path}: {exc}") from None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
