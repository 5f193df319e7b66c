"""The serving benchmark's statistics on hand-made timings, its prompts and arrivals, and its
client against a fake OpenAI-compatible server (aiohttp.web on a loopback port: no model)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from rlt_engine.bench.serving import (
    RANDOM_TOKEN_IDS,
    RequestResult,
    ServingBenchConfig,
    ServingBenchError,
    _error_text,
    arrival_offsets,
    chunk_latencies,
    client_session,
    distribution,
    gsm8k_prompts,
    percentile,
    random_prompts,
    request_tpot,
    run_benchmark,
    send_request,
    summarize,
)

URL = "http://bench.test"


# -- statistics ---------------------------------------------------------------------------
def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_chunk_latencies_one_token_per_chunk() -> None:
    ttft, itl = chunk_latencies(10.0, [(10.5, 1), (10.7, 1), (11.0, 1)])
    assert ttft == pytest.approx(0.5)
    assert itl == pytest.approx([0.2, 0.3])


def test_chunk_latencies_divide_a_chunks_gap_over_its_tokens() -> None:
    # the first chunk brings 2 tokens, then chunks of 2 and 4 tokens
    ttft, itl = chunk_latencies(0.0, [(1.0, 2), (1.4, 2), (2.2, 4)])
    assert ttft == 1.0
    assert itl == pytest.approx([0.2, 0.2, 0.2, 0.2, 0.2, 0.2])
    assert sum(itl) == pytest.approx(2.2 - 1.0)  # ITLs sum to E2E - TTFT (last chunk = end)


def test_chunk_latencies_without_tokens() -> None:
    assert chunk_latencies(0.0, []) == (None, [])
    assert chunk_latencies(0.0, [(0.25, 3)]) == (0.25, [])


def test_request_tpot() -> None:
    ok = RequestResult(ok=True, ttft_s=1.0, e2e_s=3.0, output_tokens=5)
    assert request_tpot(ok) == pytest.approx(0.5)
    assert request_tpot(RequestResult(ok=True, ttft_s=1.0, e2e_s=1.0, output_tokens=1)) is None
    assert request_tpot(RequestResult(ok=False, error="HTTP 500")) is None


def test_distribution_in_milliseconds() -> None:
    assert distribution([0.001, 0.002, 0.003, 0.010]) == pytest.approx(
        {"mean": 4.0, "median": 2.5, "p99": 9.79}
    )
    assert distribution([]) == {"mean": None, "median": None, "p99": None}


def test_summarize_hand_made_requests() -> None:
    results = [
        RequestResult(
            ok=True,
            ttft_s=0.1,
            itl_s=[0.05, 0.05, 0.05],
            e2e_s=0.25,
            output_tokens=4,
            prompt_tokens=10,
            chunks=4,
        ),
        RequestResult(
            ok=True,
            ttft_s=0.3,
            itl_s=[0.1, 0.1, 0.1],  # one chunk of 2 after a first chunk of 2
            e2e_s=0.5,
            output_tokens=4,
            prompt_tokens=10,
            chunks=2,
        ),
        RequestResult(ok=False, e2e_s=0.01, error="HTTP 500: boom"),
        RequestResult(ok=False, e2e_s=0.01, error="HTTP 500: boom"),
    ]
    s = summarize(results, duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 2)
    assert s["errors"] == {"HTTP 500: boom": 2}
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (20, 8)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(14.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["median"] == pytest.approx(200.0)
    # TPOT per request: (0.25 - 0.1) / 3 = 50 ms, (0.5 - 0.3) / 3 = 66.7 ms
    assert s["tpot_ms"]["mean"] == pytest.approx((50.0 + 200.0 / 3) / 2)
    assert s["itl_ms"]["mean"] == pytest.approx(75.0)
    assert s["itl_ms"]["median"] == pytest.approx(75.0)
    assert s["itl_ms"]["p99"] == pytest.approx(100.0)
    assert s["e2e_ms"]["p99"] == pytest.approx(250.0 + 0.99 * 250.0)
    assert s["tokens_per_chunk"] == pytest.approx(8 / 6)


def test_summarize_when_everything_failed() -> None:
    s = summarize([RequestResult(ok=False, error="x")], duration_s=0.0)
    assert (s["completed"], s["failed"], s["output_throughput"]) == (0, 1, 0.0)
    assert s["ttft_ms"]["mean"] is None and s["tokens_per_chunk"] is None


# -- prompts, arrivals, settings ----------------------------------------------------------
def test_random_prompts_are_seeded_and_in_range() -> None:
    prompts = random_prompts(5, 7, seed=3)
    assert [len(p) for p in prompts] == [7] * 5
    low, high = RANDOM_TOKEN_IDS
    assert all(low <= t < high for p in prompts for t in p)
    assert prompts == random_prompts(5, 7, seed=3)
    assert prompts != random_prompts(5, 7, seed=4)
    assert len({tuple(p) for p in prompts}) == 5  # distinct, so no prefix-cache reuse


def test_gsm8k_prompts_from_a_jsonl_file(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    questions = [f"What is {i} + {i}?" for i in range(3)]
    path.write_text("".join(json.dumps({"question": q, "answer": "x"}) + "\n" for q in questions))
    prompts = gsm8k_prompts(path, 7, seed=0)
    assert len(prompts) == 7 and set(prompts) == set(questions)  # cycled
    assert prompts == gsm8k_prompts(path, 7, seed=0)
    path.write_text('{"question": "ok?"}\n{"answer": 1}\n')
    with pytest.raises(ServingBenchError, match="line 2"):
        gsm8k_prompts(path, 1, seed=0)
    with pytest.raises(ServingBenchError, match="No such file"):
        gsm8k_prompts(tmp_path / "missing.jsonl", 1, seed=0)


def test_poisson_arrivals() -> None:
    assert arrival_offsets(4, math.inf, seed=0) == [0.0] * 4
    times = arrival_offsets(20_000, 50.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert times == arrival_offsets(20_000, 50.0, seed=1)
    mean_gap = times[-1] / (len(times) - 1)
    assert mean_gap == pytest.approx(1 / 50, rel=0.03)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"url": "localhost:8000"}, "url must start with http"),
        ({"num_prompts": 0}, "num_prompts must be >= 1"),
        ({"request_rate": 0.0}, "request_rate must be > 0"),
        ({"max_concurrency": 0}, "max_concurrency must be >= 1"),
        ({"dataset": "sharegpt"}, "dataset must be one of"),
        ({"dataset": "gsm8k"}, "needs dataset_path"),
        ({"dataset_path": Path("q.jsonl")}, "dataset_path is for dataset gsm8k"),
    ],
)
def test_config_refuses_bad_settings(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(ServingBenchError, match=needle):
        ServingBenchConfig(**{"url": URL, **fields})


def test_base_url_drops_v1() -> None:
    assert ServingBenchConfig(url=URL + "/v1/").base_url == URL
    assert ServingBenchConfig(url=URL + "/").base_url == URL


def test_error_text() -> None:
    body = json.dumps({"error": {"message": "the model 'x' does not exist", "code": 404}})
    assert _error_text(404, body.encode()) == "HTTP 404: the model 'x' does not exist"
    assert _error_text(422, b'{"detail": "bad"}') == "HTTP 422: bad"
    assert _error_text(502, b"") == "HTTP 502"


# -- the client against a fake server -----------------------------------------------------
class FakeServer:
    """/v1/models and a streaming /v1/completions: `per_chunk` tokens a chunk, with
    `token_ids` (as rlt serve sends them) or text only (as other servers do)."""

    def __init__(
        self,
        *,
        per_chunk: int = 1,
        token_ids: bool = True,
        usage: bool = True,
        api_key: str | None = None,
        fail_every: int = 0,
    ) -> None:
        self.per_chunk, self.token_ids, self.usage = per_chunk, token_ids, usage
        self.api_key, self.fail_every = api_key, fail_every
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = self.most_in_flight = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})
        if request.path != "/v1/completions":
            return web.json_response({"detail": "Not Found"}, status=404)
        body = await request.json()
        self.bodies.append(body)
        if body["model"] != "fake-model":
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            return web.json_response({"error": {"message": "injected"}}, status=500)
        # in flight from here until just before [DONE]: the client cannot start its next
        # request (max_concurrency) before it has read that
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await asyncio.sleep(0.05)  # long enough for unlimited requests to overlap
            for event in self._events(body):
                await response.write(event)
        finally:
            self.in_flight -= 1
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _events(self, body: dict[str, Any]) -> list[bytes]:
        events, sent, total = [], 0, body["max_tokens"]
        while sent < total:
            k = min(self.per_chunk, total - sent)
            choice: dict[str, Any] = {"index": 0, "text": "ab" * k, "finish_reason": None}
            if self.token_ids:
                choice["token_ids"] = list(range(k))
            events.append(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            sent += k
        if self.usage and body.get("stream_options", {}).get("include_usage"):
            prompt = len(body["prompt"]) if isinstance(body["prompt"], list) else 11
            usage = {"prompt_tokens": prompt, "completion_tokens": total}
            events.append(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        return events


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _serve(handler: Handler, work: Callable[[str], Awaitable[Any]]) -> Any:
    """`work(url)` against `handler` served on a free loopback port."""
    app = web.Application()
    app.router.add_route("*", "/{path:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        return await work(f"http://{host}:{port}")
    finally:
        await runner.cleanup()


def _bench(handler: Handler, on_progress: Any = None, path: str = "", **fields: Any) -> Any:
    async def work(url: str) -> dict[str, Any]:
        config = ServingBenchConfig(**{"url": url + path, **fields})
        return await run_benchmark(config, on_progress)

    return asyncio.run(_serve(handler, work))


def _run(server: FakeServer, **fields: Any) -> dict[str, Any]:
    return _bench(server.handle, **fields)


def test_benchmark_counts_tokens_and_requests() -> None:
    server = FakeServer(per_chunk=2)
    seen: list[tuple[int, int, int]] = []
    fields = dict(num_prompts=6, input_len=5, output_len=7)
    report = _bench(server.handle, lambda *a: seen.append(a), **fields)
    assert report["model"] == "fake-model"  # the first id of /v1/models
    assert (report["completed"], report["failed"]) == (6, 0)
    assert report["total_output_tokens"] == 6 * 7 and report["total_input_tokens"] == 6 * 5
    assert report["tokens_per_chunk"] == pytest.approx(7 / 4)  # chunks of 2, 2, 2, 1
    assert report["ttft_ms"]["mean"] > 0 and report["itl_ms"]["mean"] is not None
    assert seen[0] == (0, 0, 6) and seen[-1] == (6, 0, 6)
    probe, *measured = server.bodies
    assert probe["max_tokens"] == 2 and len(measured) == 6
    body = measured[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["max_tokens"] == 7 and len(body["prompt"]) == 5


def test_text_only_chunks_count_one_token_and_usage_wins() -> None:
    report = _run(FakeServer(per_chunk=3, token_ids=False), num_prompts=2, output_len=6)
    assert report["total_output_tokens"] == 12  # from usage, though 2 chunks a request
    assert report["tokens_per_chunk"] == pytest.approx(3.0)
    report = _run(FakeServer(per_chunk=3, token_ids=False, usage=False), num_prompts=2)
    assert report["total_output_tokens"] == 2 * 11  # counted: 11 chunks of text, 1 each


def test_max_concurrency_bounds_requests_in_flight() -> None:
    server = FakeServer()
    report = _run(server, num_prompts=8, output_len=4, max_concurrency=2)
    assert report["completed"] == 8 and server.most_in_flight == 2
    server = FakeServer()
    _run(server, num_prompts=8, output_len=4)
    assert server.most_in_flight == 8  # rate inf, no limit: all at once


def test_failed_requests_are_counted_with_their_error() -> None:
    report = _run(FakeServer(fail_every=3), num_prompts=8, output_len=3)
    # bodies 3 and 6 and 9 fail (the probe is body 1)
    assert (report["completed"], report["failed"]) == (5, 3)
    assert report["errors"] == {"HTTP 500: injected": 3}
    assert report["total_output_tokens"] == 5 * 3


def test_gsm8k_prompts_are_sent_as_text(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "How many?"}\n')
    server = FakeServer()
    report = _run(server, num_prompts=2, dataset="gsm8k", dataset_path=path, output_len=3)
    assert report["total_input_tokens"] == 2 * 11 and report["input_len"] is None
    assert server.bodies[-1]["prompt"] == "How many?"


def test_extension_fields_and_api_key_are_sent() -> None:
    server = FakeServer(api_key="sekrit")
    report = _run(server, num_prompts=1, api_key="sekrit", extra_body={"exit_threshold": 0.5})
    assert report["completed"] == 1 and server.bodies[-1]["exit_threshold"] == 0.5


@pytest.mark.parametrize(
    ("server", "fields", "needle"),
    [
        (FakeServer(api_key="k"), {}, "401 Unauthorized: no api_key given"),
        (FakeServer(api_key="k"), {"api_key": "wrong"}, "api_key given was refused"),
        (FakeServer(), {"model": "other"}, r"test request .* failed: HTTP 404: no such model"),
    ],
)
def test_server_refusals_are_one_readable_error(
    server: FakeServer, fields: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ServingBenchError, match=needle):
        _run(server, num_prompts=1, **fields)


def test_wrong_base_url_is_a_readable_404() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=404, text="Not Found")

    with pytest.raises(ServingBenchError, match=r"404 Not Found: is .*/api the base URL"):
        _bench(handler, path="/api", num_prompts=1)


def test_in_stream_error_fails_the_request() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        error = {"error": {"message": "the request failed", "code": 500}}
        body = f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n"
        return web.Response(text=body, content_type="text/event-stream")

    async def one(url: str) -> RequestResult:
        async with client_session() as session:
            return await send_request(session, url, {"model": "m", "prompt": [1]})

    result = asyncio.run(_serve(handler, one))
    assert not result.ok and result.error == "in-stream error 500: the request failed"


def test_an_unreachable_server_is_one_readable_error() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=500)

    async def work(url: str) -> str:
        return url

    url = asyncio.run(_serve(handler, work))  # a port that was just closed
    config = ServingBenchConfig(url=url, num_prompts=1)
    with pytest.raises(ServingBenchError, match=r"cannot connect to .*: is the server running"):
        asyncio.run(run_benchmark(config))
