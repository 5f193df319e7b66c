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


# Prepended to a script for a plain Triton kernel: `triton_ptx(fn, const, sig, **options)`
# compiles the @jit `fn` for sm_90 with those constexprs and argument types (every other
# argument i32), pointers and strides 16-divisible as the launch specialises them.
TRITON_PTX = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def triton_ptx(fn, const, sig, **options):
    names = fn.arg_names
    types = {n: "i32" for n in names} | dict.fromkeys(const, "constexpr") | sig
    aligned = [a for a in names if a.endswith("_ptr") or a.startswith("stride")]
    src = ASTSource(fn, types, constexprs={(names.index(c),): v for c, v in const.items()},
                    attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def ptxas_usage(ptx):
    # [registers a thread, spill bytes stored] of `ptx` as ptxas (triton's own) builds it for
    # sm_90a
    import re, subprocess, tempfile
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(ptx)
        done = subprocess.run([knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", f"{tmp}/k.ptx",
                               "-o", f"{tmp}/k.cubin"], capture_output=True, text=True,
                              check=True)
    log = done.stdout + done.stderr
    return [int(re.search(r"Used (\d+) registers", log).group(1)),
            int(re.search(r"(\d+) bytes spill stores", log).group(1))]
"""
