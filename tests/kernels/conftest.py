"""Without CUDA the Triton kernels run under the Triton interpreter, which only works when
TRITON_INTERPRET=1 is set before triton is first imported in the process (triton builds its own
@jit helpers, such as tl.max, in one mode at import). pytest imports this file before the test
modules of this folder; no earlier test module imports triton (rlt_engine.kernels imports it
lazily). If one ever does, `supported()` says so and the tests here fail with that reason. On a
CUDA machine nothing is set and the kernels are compiled."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
