"""A record of paged_attention's tensor-core kernel launches, for tests that check which
form a launch took (its grid and constexprs) without changing what it computes."""

from __future__ import annotations

import pytest

from rlt_engine.kernels import paged_attention as pa


def record_attention_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple, dict]]:
    """For the rest of the test, each launch of `_paged_attention_kernel` appends (its grid,
    its keyword arguments) to the returned list, then runs as it would have."""
    launches: list[tuple[tuple, dict]] = []
    real = pa._kernel

    class Recorded:
        def __init__(self, kernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, kwargs))
                return self.kernel[grid](*args, **kwargs)

            return launch

    def kernel(fn, interpret):
        built = real(fn, interpret)
        return Recorded(built) if fn is pa._paged_attention_kernel else built

    monkeypatch.setattr(pa, "_kernel", kernel)
    return launches
