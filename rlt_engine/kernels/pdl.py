"""Programmatic dependent launch (PDL, Hopper and later) for the decode kernels.

A kernel launched with PDL may start while the kernel before it on the stream is still running,
once every program of that one has called `griddepcontrol.launch_dependents` (or exited): the
launch latency and the kernel's prologue then overlap the previous kernel instead of leaving an
idle gap. The contract every kernel here follows when its USE_PDL constexpr is set:

- `tl.extra.cuda.gdc_wait()` in every program before it touches memory that an earlier kernel
  writes, or reads and a later kernel may overwrite (activations, caches, workspaces, counters).
  It waits for the previous grid to complete with its memory flushed, and since that grid
  waited in turn, for every earlier one. Only data no kernel writes (the weights) may be read
  before it: the small GEMM prefetches its weight tile into L2 there.
- `tl.extra.cuda.gdc_launch_dependents()` right after the wait: the next kernel launches while
  this one computes (its programs park in their own wait), one kernel ahead at most.

Launches carry `launch_pdl=True` only where `enabled(device)`: CUDA compute capability >= 9.0,
compiled (never under the interpreter), and RLT_PDL=1 (off by default until measured). CUDA
graphs capture the launches as programmatic edges, so a replay keeps the overlap. Values never
change: only the timing does.
"""

from __future__ import annotations

import os

import torch

__all__ = ["enabled", "launch_options"]

_ENABLED: dict[int, bool] = {}


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (see the module docstring)."""
    if device.type != "cuda" or os.environ.get("RLT_PDL", "0") != "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ENABLED:
        from rlt_engine.kernels import paged_attention as _pa

        ok = _pa.supported(device)[0] and torch.cuda.get_device_capability(index)[0] >= 9
        _ENABLED[index] = ok
    return _ENABLED[index]


def launch_options(device: torch.device) -> dict[str, bool]:
    """The launch keywords for a kernel that has a USE_PDL constexpr: USE_PDL always, and
    launch_pdl (which the interpreter does not take) only when PDL is on."""
    if enabled(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}
