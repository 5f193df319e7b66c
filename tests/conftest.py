"""Shared fixtures: tiny checkpoints on disk (written once per session), the real Ouro tokenizer
(checked in under tests/fixtures/ouro-1.4b) and the optional shared data dir.

`tests/` and the repository root go on sys.path, so any test module can `import tiny_checkpoints`
and the package imports even without an editable install.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Without CUDA the Triton kernels run under the interpreter, which must be chosen before triton
# is first imported (it builds its helpers in one mode at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS_DIR = Path(__file__).resolve().parent
for _path in (TESTS_DIR, TESTS_DIR.parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import tiny_checkpoints  # noqa: E402  (needs the sys.path entries above)

# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine spinning OpenMP
# threads make small kernels a hundred times slower.
torch.set_num_threads(1)


SHARED_SKIP = "needs the optional shared data directory"
TRITON_SKIP = "needs triton (not installed: the CPU torch wheel does not bring it)"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Without triton, the Triton kernels cannot run even interpreted: their tests (the kernels
    folder, a triton backend parameter, the models' fused fast path) skip, and the end of the
    run counts them."""
    if HAS_TRITON:
        return
    skip = pytest.mark.skip(reason=TRITON_SKIP)
    for item in items:
        node = item.nodeid.replace("\\", "/")
        if "triton" in node or "tests/kernels/" in node or "test_fast_path" in node:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _collector_as_it_was() -> Iterator[None]:
    """A command run in-process (`rlt bench` through CliRunner) freezes the heap and spaces the
    young collections, as it should in a process of its own (rlt_engine/heap.py); the test
    process gets its collector back after each test."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared beside the repository (or $RLT_SHARED_DIR): optional data too big to check in
    (datasets). Skips the test when absent; the run's summary says so in one loud line."""
    if not tiny_checkpoints.SHARED_DIR.is_dir():
        pytest.skip(f"{SHARED_SKIP} {tiny_checkpoints.SHARED_DIR} (absent)")
    return tiny_checkpoints.SHARED_DIR


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Skips for missing optional data are counted at the end, where nobody can miss them."""
    skipped = [str(getattr(r, "longrepr", "")) for r in terminalreporter.stats.get("skipped", [])]
    shared = sum(SHARED_SKIP in r for r in skipped)
    if shared:
        terminalreporter.write_line(
            f"NOTE: {shared} test(s) skipped: they need {tiny_checkpoints.SHARED_DIR} "
            "(set RLT_SHARED_DIR to run them)",
            yellow=True,
            bold=True,
        )
    triton = sum(TRITON_SKIP in r for r in skipped)
    if triton:
        terminalreporter.write_line(
            f"NOTE: {triton} test(s) skipped: they need triton, which is not installed "
            "(pip install triton to run the Triton kernels under the interpreter)",
            yellow=True,
            bold=True,
        )


@pytest.fixture(scope="session")
def ouro_real_dir() -> Path:
    """The real Ouro-1.4B config and tokenizer (no weights), from tests/fixtures: never skips."""
    path = tiny_checkpoints.OURO_REAL_DIR
    missing = [n for n in tiny_checkpoints.OURO_TOKENIZER_FILES if not (path / n).is_file()]
    assert not missing, f"{path} lacks {missing}: the checked-in fixture is incomplete"
    return path


@pytest.fixture(scope="session")
def tiny_ouro_dir(tmp_path_factory: pytest.TempPathFactory, ouro_real_dir: Path) -> Path:
    """Tiny random Ouro checkpoint with the real Ouro tokenizer. Treat as read-only."""
    out = tmp_path_factory.mktemp("tiny-ouro")
    return tiny_checkpoints.write_tiny_ouro(out, tokenizer_from=ouro_real_dir)


@pytest.fixture(scope="session")
def tiny_nanbeige_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Nanbeige checkpoint with its synthetic tokenizer. Treat as read-only."""
    return tiny_checkpoints.write_tiny_nanbeige(tmp_path_factory.mktemp("tiny-nanbeige"))


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Ouro weights (4 loops, exit gate) without a tokenizer: loads in milliseconds,
    token-id prompts only."""
    return tiny_checkpoints.write_tiny_ouro(
        tmp_path_factory.mktemp("tiny-ouro-ids"), tokenizer_from=None
    )


# -- hypothesis profiles (the property tests): "ci" by default, "long" by hand or nightly ------
# HYPOTHESIS_PROFILE=long python -m pytest tests/test_engine_property.py \
#     tests/test_memory_policies_property.py
from hypothesis import HealthCheck, settings  # noqa: E402

_HYPOTHESIS_COMMON = dict(
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# max_examples counts per parametrized case: the property tests run once per memory mode
settings.register_profile("ci", max_examples=3, derandomize=True, **_HYPOTHESIS_COMMON)
settings.register_profile(
    "long", max_examples=30, derandomize=False, print_blob=True, **_HYPOTHESIS_COMMON
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
