from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_process import DEMO_ARGS, ServerProcess


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One demo-model server shared by the tests that do not need their own flags."""
    proc = ServerProcess(*DEMO_ARGS).wait_healthy()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def demo_llm():  # type: ignore[no-untyped-def]
    """The in-process engine with the server's settings, to compare outputs with."""
    from rlt_engine import LLM

    return LLM("demo", max_num_seqs=16, dtype="float32", device="cpu")
