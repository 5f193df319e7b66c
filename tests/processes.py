"""Processes seen from /proc (Linux): a server's children, the ones multiprocessing spawned
(engine and API server processes), whether one still runs; and waiting for a condition."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable


def children(pid: int) -> list[int]:
    """The child processes of `pid` (of all its threads)."""
    kids: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return kids


def spawned(pid: int) -> list[int]:
    """The children of `pid` that multiprocessing spawned (not its resource tracker)."""
    out = []
    for kid in children(pid):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{kid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                out.append(kid)
    return out


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)
