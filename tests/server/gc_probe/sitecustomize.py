"""Loaded by every Python process whose path starts with this directory (the server tests set
PYTHONPATH for `rlt serve` and so for the processes it spawns): at exit, each one writes its
collector's state to $RLT_GC_PROBE_DIR/<pid>.json."""

import atexit
import gc
import json
import os
import sys

_DIR = os.environ.get("RLT_GC_PROBE_DIR")


def _write() -> None:
    state = {
        "argv": sys.argv,
        "frozen": gc.get_freeze_count(),
        "threshold": list(gc.get_threshold()),
        # a process multiprocessing started (the engine process) has a parent process
        "spawned": "multiprocessing" in sys.modules
        and sys.modules["multiprocessing"].parent_process() is not None,
    }
    with open(os.path.join(_DIR, f"{os.getpid()}.json"), "w") as f:
        json.dump(state, f)


if _DIR:
    atexit.register(_write)
