"""`rlt serve`'s processes freeze their startup heap once the engine is ready (rlt_engine/heap.py):
the API server's full collections paused it 100-190 ms at c=256 before
(benchmarks/results/2026-12-05-gc-cpu.md)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
from server_process import DEMO_ARGS, ServerProcess

from rlt_engine.heap import YOUNG_THRESHOLD

PROBE = Path(__file__).resolve().parent / "gc_probe"


def _states(into: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(into.glob("*.json"))]


def test_server_and_engine_processes_freeze_their_heaps(tmp_path: Path) -> None:
    env = {"PYTHONPATH": f"{PROBE}:{Path(__file__).resolve().parents[2]}"}
    env["RLT_GC_PROBE_DIR"] = str(tmp_path)
    proc = ServerProcess(*DEMO_ARGS, env=env).wait_healthy()
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none")
        out = client.completions.create(model="demo", prompt="Tom has", max_tokens=4)
        assert out.choices[0].text is not None
    finally:
        proc.stop()
    states = _states(tmp_path)
    server = [s for s in states if "serve" in s["argv"] and not s["spawned"]]
    engine = [s for s in states if "serve" in s["argv"] and s["spawned"]]
    assert len(server) == 1 and len(engine) == 1, states
    for state in (*server, *engine):
        assert state["frozen"] > 10_000, state  # torch / FastAPI alone are more than this
        assert state["threshold"][0] == YOUNG_THRESHOLD, state
