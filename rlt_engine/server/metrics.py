"""Prometheus metrics for `/metrics`, named as vLLM names them where vLLM has one (so
existing dashboards and load tools read them), plus `rlt:` metrics for the looped model.

Everything is recorded on the thread that delivers the engine's outputs, from each step's
`StepReport`: engine gauges from the step's stats, per-request latencies from the outputs'
timestamps (server-side, as vLLM measures them: from the handler's hand-over to the
AsyncEngine, its queue wait included). One registry per server, so several servers can
live in one process; several API server processes of one engine (`--api-server-count`) share
a multiprocess directory instead, and each one's `/metrics` reads them all.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from rlt_engine.async_engine import StepReport

if TYPE_CHECKING:
    from rlt_engine.outputs import EngineStats

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class ServerMetrics:
    def __init__(self, model_name: str, max_num_seqs: int) -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, {"model_name": model_name}
        names = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            # several API servers: one of them sets the engine's gauges, the others hold 0
            mode = "livemax"
            return Gauge(name, doc, names, registry=r, multiprocess_mode=mode).labels(**label)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(**label)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**label)

        self.running = gauge("vllm:num_requests_running", "Requests running on the engine.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting or preempted.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1 (1 = full).")
        self.blocks_used = gauge("rlt:kv_blocks_used", "KV-cache blocks in use (all planes).")
        self.blocks_total = gauge("rlt:kv_blocks_total", "KV-cache blocks in the pool.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix-cache lookups, in tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted to CPU memory.")
        self.graph_captures = counter(
            "rlt:cuda_graph_captures",
            "CUDA graphs captured, start-up's included; one captured while serving stalls "
            "every request in flight.",
        )
        self.graph_capture_seconds = counter(
            "rlt:cuda_graph_capture_seconds", "Host seconds spent capturing CUDA graphs."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self._success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            [*names, "finished_reason"],
            registry=r,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            _LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", _LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS
        )
        self.request_prompt = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS
        )
        self.request_generation = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )
        self._by_depth = Counter(
            "rlt:output_tokens_by_exit_depth",
            "Output tokens by the loop depth they exited at.",
            [*names, "depth"],
            registry=r,
        )
        self.loops_per_token = histogram(
            "rlt:loops_per_token",
            "Mean loops per output token, per finished request.",
            (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 6.0, 8.0, 16.0),
        )
        self.batch_size = histogram(
            "rlt:traversal_batch_size",
            "Rows in the decode traversals of a step.",
            tuple(float(2**i) for i in range(max_num_seqs.bit_length() + 1)),
        )
        self.step_seconds = histogram(
            "rlt:engine_step_seconds", "Wall time of one engine step.", _LATENCY_BUCKETS
        )
        self._model = model_name
        self._depth_counters: dict[int, Counter] = {}  # depth -> its labelled counter
        self._seen_prefix = (0, 0, 0)  # cumulative engine counters already exported
        self._seen_graphs = (0, 0.0)  # graphs captured, seconds: already exported
        self._last_token: dict[str, tuple[float, float]] = {}  # id -> (first, latest) times
        self._loops: dict[str, int] = {}
        self._prompt_seen: set[str] = set()

    def record(self, report: StepReport) -> None:
        if report.stats is not None:  # None: another API server counts the engine
            self._record_engine(report.stats, report.wall_s)
        now = time.monotonic()
        for out in report.outputs:
            self._record_output(out, now)
        for rid in report.failed:  # a failed step: these end without a final output
            self._success.labels(self._model, "error").inc()
            self._forget(rid)

    def _record_engine(self, s: EngineStats, wall_s: float | None) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting + s.num_swapped)
        self.blocks_used.set(s.blocks_used)
        self.blocks_total.set(s.blocks_total)
        self.kv_usage.set(s.blocks_used / s.blocks_total if s.blocks_total else 0.0)
        queried, hit, preempted = s.prefix_queried_tokens, s.prefix_hit_tokens, s.preemptions
        q0, h0, p0 = self._seen_prefix
        self.prefix_queries.inc(max(0, queried - q0))
        self.prefix_hits.inc(max(0, hit - h0))
        self.preemptions.inc(max(0, preempted - p0))
        self._seen_prefix = (queried, hit, preempted)
        g0, gs0 = self._seen_graphs
        self.graph_captures.inc(max(0, s.graphs_captured - g0))
        self.graph_capture_seconds.inc(max(0.0, s.graph_capture_s - gs0))
        self._seen_graphs = (s.graphs_captured, s.graph_capture_s)
        if wall_s is not None:  # a step ran (not only aborts)
            if s.decode_rows:
                self.batch_size.observe(s.decode_rows)
            self.step_seconds.observe(wall_s)

    def _record_output(self, out, now: float) -> None:  # type: ignore[no-untyped-def]
        rid, n = out.request_id, len(out.new_token_ids)
        if rid not in self._prompt_seen:
            self._prompt_seen.add(rid)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.request_prompt.observe(len(out.prompt_token_ids))
        if n:
            self.generation_tokens.inc(n)
            for depth in out.new_exit_depths:
                child = self._depth_counters.get(depth)
                if child is None:  # labels() per token was a fifth of record()'s time
                    child = self._by_depth.labels(self._model, str(depth))
                    self._depth_counters[depth] = child
                child.inc()
            self._loops[rid] = self._loops.get(rid, 0) + sum(out.new_exit_depths)
            times = self._last_token.get(rid)
            if times is None:
                first = out.metrics.first_token_time or now
                self.ttft.observe(max(0.0, first - out.metrics.arrival_time))
                times = (first, first)
                n -= 1  # the first token's latency is the TTFT
            for _ in range(n):
                self.itl.observe(max(0.0, now - times[1]) / max(n, 1))
            self._last_token[rid] = (times[0], now)
        if out.finished:
            self._success.labels(self._model, out.finish_reason or "abort").inc()
            self.e2e.observe(max(0.0, now - out.metrics.arrival_time))
            tokens = out.num_tokens
            self.request_generation.observe(tokens)
            times, loops = self._forget(rid)
            if times is not None and tokens > 1:
                self.tpot.observe((times[1] - times[0]) / (tokens - 1))
            if tokens:
                self.loops_per_token.observe(loops / tokens)

    def _forget(self, rid: str) -> tuple[tuple[float, float] | None, int]:
        """Drop what a request that ended held here: its (first, latest) token times and
        its loops so far."""
        self._prompt_seen.discard(rid)
        return self._last_token.pop(rid, None), self._loops.pop(rid, 0)

    def render(self) -> bytes:
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:  # several API servers: all of theirs
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
