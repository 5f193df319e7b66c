"""Compile kernels for sm_90 on the CPU, in a process of its own: the test process imported
triton for the interpreter (TRITON_INTERPRET=1), whose @jit helpers cannot be compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_compile_script(script: str) -> dict:
    """Run `script` (it gets the repository root as argv[1]) without the interpreter; the JSON
    object it prints last."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(ROOT)], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
