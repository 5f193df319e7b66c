"""Small-GEMM dispatch tables (kernels/small_gemm.py), one module per GPU model, named by
`module_name` and written by benchmarks/bench_small_gemm.py on that GPU. A module's TABLE holds
"device" (the name torch gives the GPU), "capability", "sms" (its layout), "triton", "torch" and
"entries": "NxK:m<bucket>:<dtype>" -> a row of FIELDS. A GPU takes the table of its own name,
else one of its layout (`small_gemm.pick_table`), as vLLM keeps a kernel config per device."""

from __future__ import annotations

import importlib
import pkgutil
import re

FIELDS = ("backend", "block_n", "block_k", "split_k", "num_warps", "num_stages", "us", "cublas_us")


def module_name(device_name: str) -> str:
    """The module of a GPU's table: "NVIDIA H100 80GB HBM3" -> "nvidia_h100_80gb_hbm3"."""
    return re.sub(r"[^0-9a-z]+", "_", device_name.lower()).strip("_")


def _load() -> tuple[dict, ...]:
    names = sorted(m.name for m in pkgutil.iter_modules(__path__))
    return tuple(importlib.import_module(f"{__name__}.{name}").TABLE for name in names)


TABLES = _load()  # in module-name order


def table_of(device_name: str) -> dict | None:
    """The table tuned on the GPU named `device_name`, if any."""
    return next((t for t in TABLES if t.get("device") == device_name), None)
