"""Serving benchmark against any OpenAI-compatible server (`rlt bench --url`).

A client on asyncio + aiohttp streams `POST {url}/v1/completions` requests (`stream: true`,
`stream_options.include_usage`, `ignore_eos`, `max_tokens` = the output length, temperature 0)
in the manner of `vllm bench serve`, and measures what a user of the server sees:

- prompts: `random` (random token ids of the input length, sent as a token-id list, which the
  OpenAI API allows) or `gsm8k` (the `question` field of a JSONL file);
- arrivals: a Poisson process at `request_rate` requests/s (inf: all at once) drawn from a
  seeded RNG, with at most `max_concurrency` requests in flight (a semaphore);
- per request: TTFT (send to the first chunk that carries tokens), ITL (gaps between chunks
  that carry tokens, per token: a chunk of k tokens contributes k values of gap / k, so a
  request's ITLs sum to E2E - TTFT; k is the chunk's `token_ids` length where the server sends
  that extension, as `rlt serve` does, else 1), E2E, output tokens (the final usage chunk,
  else the tokens counted), and success or the error;
- aggregate: mean / median / p99 of TTFT, TPOT ((E2E - TTFT) / (tokens - 1) per request), ITL
  and E2E in ms; request, output-token and total-token throughput over the benchmark's
  duration (first send to last response); completed and failed counts.

Before measuring, `GET /v1/models` names the model (the first id unless one is given) and one
short test request checks that the server takes ours: a server that cannot be reached, a
missing or wrong API key, a wrong URL or model fail there with one readable `ServingBenchError`.
The statistics are pure functions (`chunk_latencies`, `request_tpot`, `distribution`,
`summarize`). No torch.

aiohttp, as `vllm bench serve` uses, not httpx: at c=8, with 8 requests ending and 8 starting
together, httpx took 15-23 ms of client time to put a request on the wire, against 3-7 ms for
aiohttp (CPU trace, benchmarks/results/2026-12-02-riding-graphs-h200.md), and a load
generator's own latency is counted in every TTFT it reports.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from rlt_engine.bench.stats import percentile

DATASETS = ("random", "gsm8k")
# Random prompt ids are drawn from [low, high): below every vocabulary we serve (the demo
# model's is 4096) and above the special tokens, which sit at the low ids of the tokenizers
# we know (Ouro: 0..16).
RANDOM_TOKEN_IDS = (100, 4000)
CONNECT_TIMEOUT_S = 30.0
PROBE_TIMEOUT_S = 300.0  # the test request may wait for a model to warm up
PERCENTILE = 99

ProgressCallback = Callable[[int, int, int], None]  # (done, failed, total)


class ServingBenchError(ValueError):
    """The benchmark cannot run against this server (one line, for the command line)."""


@dataclass(frozen=True)
class ServingBenchConfig:
    url: str  # the server's base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)
    num_prompts: int = 200
    request_rate: float = math.inf  # requests/s of the Poisson arrivals; inf = all at once
    max_concurrency: int | None = None  # requests in flight at most; None = no limit
    input_len: int = 64  # random prompts: token ids per prompt
    output_len: int = 32  # max_tokens, with ignore_eos
    dataset: str = "random"
    dataset_path: Path | None = None  # gsm8k: a JSONL file of {"question": ...}
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    seed: int = 0
    extra_body: dict[str, Any] = field(default_factory=dict)  # extension fields for each request

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ServingBenchError(f"url must start with http:// or https://, got {self.url!r}")
        for name, least in (("num_prompts", 1), ("input_len", 1), ("output_len", 1)):
            value = getattr(self, name)
            if value < least:
                raise ServingBenchError(f"{name} must be >= {least}, got {value}")
        if not self.request_rate > 0:
            raise ServingBenchError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ServingBenchError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.dataset not in DATASETS:
            raise ServingBenchError(
                f"dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}"
            )
        if self.dataset == "gsm8k" and self.dataset_path is None:
            raise ServingBenchError("dataset='gsm8k' needs dataset_path (a JSONL of questions)")
        if self.dataset == "random" and self.dataset_path is not None:
            raise ServingBenchError("dataset_path is for dataset gsm8k (random makes its own)")

    @property
    def base_url(self) -> str:
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds."""

    ok: bool
    start_s: float = 0.0  # send time, from the benchmark's start
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    chunks: int = 0  # chunks that carried tokens
    error: str | None = None


# -- prompts and arrivals ---------------------------------------------------------------------
def random_prompts(n: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(f"prompts-{seed}")
    low, high = RANDOM_TOKEN_IDS
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(n)]


def gsm8k_prompts(path: Path, n: int, seed: int) -> list[str]:
    """`n` questions from a JSONL file of {"question": ...} objects, in a seeded order (cycled
    when the file has fewer)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ServingBenchError(f"dataset_path {path}: {exc.strerror or exc}") from None
    questions = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            question = json.loads(line).get("question")
        except (json.JSONDecodeError, AttributeError):
            question = None
        if not isinstance(question, str) or not question:
            raise ServingBenchError(
                f"dataset_path {path}, line {number}: not a JSON object with a 'question' string"
            )
        questions.append(question)
    if not questions:
        raise ServingBenchError(f"dataset_path {path}: no questions")
    random.Random(f"gsm8k-{seed}").shuffle(questions)
    return [questions[i % len(questions)] for i in range(n)]


def load_prompts(config: ServingBenchConfig) -> list[str | list[int]]:
    if config.dataset == "gsm8k":
        assert config.dataset_path is not None
        return list(gsm8k_prompts(config.dataset_path, config.num_prompts, config.seed))
    return list(random_prompts(config.num_prompts, config.input_len, config.seed))


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process at `rate` requests/s (the first
    request at 0), or all at 0 when the rate is infinite."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals-{seed}")
    out, at = [], 0.0
    for _ in range(n):
        out.append(at)
        at += rng.expovariate(rate)
    return out


# -- statistics (pure) ------------------------------------------------------------------------


def chunk_latencies(
    start: float, chunks: Sequence[tuple[float, int]]
) -> tuple[float | None, list[float]]:
    """(TTFT, ITLs) of one request from its token-carrying chunks, (arrival time, tokens).

    TTFT is the first chunk's arrival after `start`. Each later chunk of k tokens contributes
    its gap to the chunk before, divided over its k tokens (k values of gap / k); tokens that
    came with the first chunk have no gap of their own."""
    if not chunks:
        return None, []
    first = chunks[0][0]
    itl: list[float] = []
    previous = first
    for at, tokens in chunks[1:]:
        k = max(1, tokens)
        itl.extend([(at - previous) / k] * k)
        previous = at
    return first - start, itl


def request_tpot(result: RequestResult) -> float | None:
    """Seconds per output token after the first: (E2E - TTFT) / (tokens - 1)."""
    if not result.ok or result.ttft_s is None or result.output_tokens < 2:
        return None
    return (result.e2e_s - result.ttft_s) / (result.output_tokens - 1)


def distribution(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean, median and p99 in milliseconds (None for no values)."""
    if not values_s:
        return {"mean": None, "median": None, "p99": None}
    ms = [1e3 * v for v in values_s]
    return {
        "mean": statistics.fmean(ms),
        "median": statistics.median(ms),
        "p99": percentile(ms, PERCENTILE),
    }


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """The aggregate over requests (failed ones count only as failures)."""
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens or 0 for r in done)
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    tpots = [t for t in (request_tpot(r) for r in done) if t is not None]
    chunks = sum(r.chunks for r in done)
    errors = Counter(r.error or "unknown error" for r in results if not r.ok)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": dict(errors.most_common()),
        "duration_s": duration_s,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": rate(len(done)),
        "output_throughput": rate(output),
        "total_token_throughput": rate(prompt + output),
        "ttft_ms": distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": distribution(tpots),
        "itl_ms": distribution([t for r in done for t in r.itl_s]),
        "e2e_ms": distribution([r.e2e_s for r in done]),
        "tokens_per_chunk": output / chunks if chunks else None,
    }


# -- the client -------------------------------------------------------------------------------
def _error_text(status: int, body: bytes) -> str:
    """`HTTP 404: message` from an OpenAI-style error body (or the body's start)."""
    message = body.decode("utf-8", "replace").strip()
    try:
        parsed = json.loads(message)
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        err = parsed.get("error", parsed.get("detail"))
        if isinstance(err, dict):
            err = err.get("message")
        if isinstance(err, str):
            message = err
    text = f"HTTP {status}"
    return f"{text}: {' '.join(message.split())[:300]}" if message else text


def _chunk_tokens(choice: dict[str, Any]) -> int:
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    return 1 if choice.get("text") else 0


def _event_error(event: dict[str, Any]) -> str | None:
    err = event.get("error")
    if err is None:
        return None
    message = err.get("message") if isinstance(err, dict) else err
    code = err.get("code") if isinstance(err, dict) else None
    return f"in-stream error{f' {code}' if code else ''}: {message}"


async def send_request(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any], t0: float = 0.0
) -> RequestResult:
    """Stream one completion from `url` (the server's base URL); never raises for the
    server's or the network's faults."""
    start = time.perf_counter()
    chunks: list[tuple[float, int]] = []
    usage: dict[str, Any] | None = None
    error: str | None = None
    try:
        async with session.post(f"{url}/v1/completions", json=payload) as response:
            if response.status != 200:
                error = _error_text(response.status, await response.read())
            else:
                async for raw in response.content:  # one line at a time
                    if not raw.startswith(b"data:"):
                        continue
                    data = raw[5:].strip()
                    if data == b"[DONE]":
                        break
                    now = time.perf_counter()
                    event = json.loads(data)
                    error = _event_error(event)
                    if error is not None:
                        break
                    if event.get("usage"):
                        usage = event["usage"]
                    tokens = sum(_chunk_tokens(c) for c in event.get("choices") or ())
                    if tokens:
                        chunks.append((now, tokens))
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except json.JSONDecodeError as exc:
        error = f"malformed stream chunk: {exc}"
    end = time.perf_counter()
    ttft, itl = chunk_latencies(start, chunks)
    counted = sum(k for _, k in chunks)
    result = RequestResult(ok=False, start_s=start - t0, e2e_s=end - start, error=error)
    if error is None and ttft is None:
        result.error = "no tokens in the response"
    if result.error is not None:
        return result
    result.ok, result.ttft_s, result.itl_s, result.chunks = True, ttft, itl, len(chunks)
    result.output_tokens = int((usage or {}).get("completion_tokens") or counted)
    prompt_tokens = (usage or {}).get("prompt_tokens")
    if prompt_tokens is None and isinstance(payload.get("prompt"), list):
        prompt_tokens = len(payload["prompt"])
    result.prompt_tokens = prompt_tokens
    return result


def _payload(
    config: ServingBenchConfig, model: str, prompt: str | list[int], max_tokens: int
) -> dict[str, Any]:
    return {
        **config.extra_body,
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _served_model(session: aiohttp.ClientSession, config: ServingBenchConfig) -> str:
    """The model to ask for: as given, else the first of GET /v1/models; connection, 401 and
    404 failures become one readable line."""
    where = f"{config.base_url}/v1/models"
    try:
        async with session.get(
            where, timeout=aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S)
        ) as response:
            status, body = response.status, await response.read()
    except aiohttp.ClientConnectorError as exc:
        reason = f" ({exc.os_error})" if exc.os_error else ""
        raise ServingBenchError(
            f"cannot connect to {config.base_url}{reason}: is the server running there?"
        ) from None
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise ServingBenchError(f"{where}: {type(exc).__name__}: {exc}") from None
    if status == 401:
        given = "the api_key given was refused" if config.api_key else "no api_key given"
        raise ServingBenchError(
            f"{where} answered 401 Unauthorized: {given} (set api_key or OPENAI_API_KEY)"
        )
    if status == 404:
        raise ServingBenchError(
            f"{where} answered 404 Not Found: is {config.base_url} the base URL of an "
            "OpenAI-compatible server (without /v1)?"
        )
    if status != 200:
        raise ServingBenchError(f"{where}: {_error_text(status, body)}")
    if config.model is not None:
        return config.model
    try:
        return str(json.loads(body)["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServingBenchError(f"{where} lists no model: give model=NAME") from None


def client_session(api_key: str | None = None) -> aiohttp.ClientSession:
    """The benchmark's HTTP client: no connection limit (the concurrency limit is the
    semaphore), no total timeout (a long generation is not a failure), a bounded connect."""
    return aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
        connector=aiohttp.TCPConnector(limit=0),
        read_bufsize=2**20,  # an SSE line (a chunk with logprobs) may pass the 64 KiB default
    )


async def run_benchmark(
    config: ServingBenchConfig, on_progress: ProgressCallback | None = None
) -> dict[str, Any]:
    """Run the benchmark; the report: the settings, then `summarize`'s keys."""
    prompts = load_prompts(config)
    offsets = arrival_offsets(config.num_prompts, config.request_rate, config.seed)
    url = config.base_url
    async with client_session(config.api_key) as session:
        model = await _served_model(session, config)
        probe = _payload(config, model, prompts[0], min(2, config.output_len))
        checked = await asyncio.wait_for(send_request(session, url, probe), PROBE_TIMEOUT_S)
        if not checked.ok:
            raise ServingBenchError(
                f"the test request to {config.base_url}/v1/completions failed: {checked.error}"
            )
        limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        done = failed = 0
        if on_progress is not None:
            on_progress(0, 0, config.num_prompts)
        t0, cpu0 = time.perf_counter(), time.process_time()

        async def one(index: int) -> RequestResult:
            nonlocal done, failed
            delay = t0 + offsets[index] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            payload = _payload(config, model, prompts[index], config.output_len)
            if limit is None:
                result = await send_request(session, url, payload, t0)
            else:
                async with limit:
                    result = await send_request(session, url, payload, t0)
            done += 1
            failed += not result.ok
            if on_progress is not None:
                on_progress(done, failed, config.num_prompts)
            return result

        results = await asyncio.gather(*(one(i) for i in range(config.num_prompts)))
        duration = time.perf_counter() - t0
        client_cpu = time.process_time() - cpu0
    rate = config.request_rate
    return {
        "backend": "openai-completions",
        "url": config.base_url,
        "model": model,
        "dataset": config.dataset,
        "dataset_path": str(config.dataset_path) if config.dataset_path else None,
        "num_prompts": config.num_prompts,
        "request_rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": config.max_concurrency,
        "input_len": config.input_len if config.dataset == "random" else None,
        "output_len": config.output_len,
        "seed": config.seed,
        "extra_body": dict(config.extra_body),
        **summarize(results, duration),
        "client_cpu_s": client_cpu,  # this process's CPU time over the run (is it the limit?)
    }


def benchmark(
    config: ServingBenchConfig, on_progress: ProgressCallback | None = None
) -> dict[str, Any]:
    """`run_benchmark` on a fresh event loop."""
    return asyncio.run(run_benchmark(config, on_progress))
