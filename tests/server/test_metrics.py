"""ServerMetrics.record against hand-made step reports: every series counts what the outputs
and stats say, once (the values a dashboard shows, read back from the registry)."""

from __future__ import annotations

import re
import time

import pytest

from rlt_engine.async_engine import StepReport
from rlt_engine.outputs import EngineStats, RequestMetrics, RequestOutput
from rlt_engine.server.metrics import ServerMetrics


def _stats(
    used: int = 10, queried: int = 0, hit: int = 0, preempted: int = 0, graphs: int = 9
) -> EngineStats:
    return EngineStats(
        2, 1, 0, used, 100, queried, hit, preempted, 2, graphs, graph_capture_s=0.1 * graphs
    )


def _out(
    rid: str, tokens: list[int], depths: list[int], total: int, reason: str | None = None
) -> RequestOutput:
    return RequestOutput(
        rid, [1, 2, 3], tokens, depths, "", None, total, reason is not None, reason,
        RequestMetrics(arrival_time=100.0, first_token_time=100.5, finish_time=None),
    )  # fmt: skip


def test_record_counts_tokens_depths_requests_and_steps() -> None:
    m = ServerMetrics("demo", 8)
    value = m.registry.get_sample_value
    label = {"model_name": "demo"}
    m.record(StepReport(_stats(queried=16, hit=8), [_out("a", [5], [4], 1)], 0.02))
    m.record(
        StepReport(
            _stats(used=12, queried=32, hit=8, preempted=1, graphs=11),
            [_out("a", [6, 7], [2, 4], 3), _out("b", [9], [3], 1)],
            0.03,
        )
    )
    m.record(
        StepReport(_stats(used=4, graphs=11), [_out("a", [], [], 3, "length")], None)
    )  # aborts only
    assert value("vllm:generation_tokens_total", label) == 4
    assert value("vllm:prompt_tokens_total", label) == 6  # a and b, once each
    depth = {d: value("rlt:output_tokens_by_exit_depth_total", label | {"depth": str(d)})
             for d in (2, 3, 4)}  # fmt: skip
    assert depth == {2: 1, 3: 1, 4: 2}
    assert value("vllm:prefix_cache_queries_total", label) == 32  # cumulative, not summed
    assert value("vllm:prefix_cache_hits_total", label) == 8
    assert value("vllm:num_preemptions_total", label) == 1
    assert value("rlt:cuda_graph_captures_total", label) == 11  # cumulative, not summed
    assert value("rlt:cuda_graph_capture_seconds_total", label) == pytest.approx(1.1)
    assert value("vllm:time_to_first_token_seconds_count", label) == 2
    assert value("vllm:time_to_first_token_seconds_sum", label) == pytest.approx(1.0)
    reason = label | {"finished_reason": "length"}
    assert value("vllm:request_success_total", reason) == 1
    assert value("rlt:loops_per_token_sum", label) == pytest.approx(10 / 3)
    # the turn that only aborted is not a step
    assert value("rlt:engine_step_seconds_count", label) == 2
    assert value("rlt:engine_step_seconds_sum", label) == pytest.approx(0.05)
    assert value("rlt:traversal_batch_size_count", label) == 2
    assert value("rlt:kv_blocks_used", label) == 4
    assert value("vllm:kv_cache_usage_perc", label) == pytest.approx(0.04)


def test_a_failed_request_counts_as_an_error_and_leaves_nothing_behind() -> None:
    """A step that fails a request sends no final output for it: the report's failed ids
    count it under finished_reason "error" and drop what the metrics held for it."""
    m = ServerMetrics("demo", 8)
    m.record(StepReport(_stats(), [_out("a", [5], [4], 1), _out("b", [6], [4], 1)], 0.02))
    m.record(StepReport(_stats(), [_out("b", [7], [4], 2)], 0.02, failed=("a",)))
    error = {"model_name": "demo", "finished_reason": "error"}
    assert m.registry.get_sample_value("vllm:request_success_total", error) == 1
    assert "a" not in m._last_token and "a" not in m._loops and "a" not in m._prompt_seen
    assert "b" in m._last_token  # still running


def test_metrics_over_http_count_what_was_served(server) -> None:
    """One request through the real server (engine process, events thread, registry): the
    counters move by exactly its tokens, its prompt and one success."""
    import httpx

    names = ("vllm:generation_tokens_total", "rlt:output_tokens_by_exit_depth_total",
             "vllm:prompt_tokens_total", "vllm:request_success_total")  # fmt: skip

    def values() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        return {n: _total(text, n) for n in names}

    before = values()
    body = {"model": "demo", "prompt": "2 + 2 =", "max_tokens": 7, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    want = {
        "vllm:generation_tokens_total": 7,
        "rlt:output_tokens_by_exit_depth_total": 7,
        "vllm:prompt_tokens_total": r.json()["usage"]["prompt_tokens"],
        "vllm:request_success_total": 1,
    }
    deadline = time.monotonic() + 10  # recorded just after the outputs are handed over
    while True:
        after = values()
        delta = {n: after[n] - before[n] for n in names}
        if delta == want or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert delta == want


def test_metrics_before_any_request_show_the_pool(demo_llm) -> None:
    """A server that has served nothing yet already reports its KV pool (and the graphs its
    start-up captured: none on the CPU): the engine's numbers come with its first turn, which
    ready sends, not with the first step."""
    import httpx
    from server_process import DEMO_ARGS, ServerProcess

    proc = ServerProcess(*DEMO_ARGS).wait_healthy()
    try:
        label = '{model_name="demo"}'
        deadline = time.monotonic() + 10  # recorded on the events thread, just after ready
        while True:
            text = httpx.get(proc.url + "/metrics", timeout=10).text
            total = _total(text, "rlt:kv_blocks_total")
            if total or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        proc.stop()
    assert total == demo_llm.engine.num_blocks > 0
    assert f"rlt:kv_blocks_used{label} 0.0" in text
    assert f"vllm:kv_cache_usage_perc{label} 0.0" in text
    assert _total(text, "rlt:cuda_graph_captures_total") == 0
    assert _total(text, "rlt:engine_step_seconds_count") == 0  # the first turn is no step


def _total(text: str, name: str) -> float:
    """The sum of a metric's samples in a /metrics page (0 before its first sample)."""
    pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$"
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))
