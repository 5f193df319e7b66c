"""Faults stay with the request they belong to: a client that leaves mid-stream, hundreds of
concurrent streams with random aborts, a request that fails inside the engine, SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import threading
from pathlib import Path

import httpx
import openai
import pytest
from processes import children, running, wait_for
from server_process import DEMO_ARGS, ServerProcess

FAULT_SERVER = Path(__file__).with_name("fault_server.py")
FAULT_MARKER = "<<inject-fault>>"


def test_disconnect_mid_stream_frees_blocks(server) -> None:
    body = {"model": "demo", "prompt": "1", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert server.metric("rlt:kv_blocks_used") > 0
    # the client is gone: the request is aborted and its blocks are back within a step
    wait_for(lambda: server.metric("rlt:kv_blocks_used") == 0)
    wait_for(lambda: server.metric("vllm:num_requests_running") == 0)
    assert 'finished_reason="abort"' in httpx.get(server.url + "/metrics").text
    assert httpx.get(server.url + "/health").status_code == 200


def test_non_streaming_disconnect_frees_blocks(server) -> None:
    body = {"model": "demo", "prompt": "1", "max_tokens": 1500, "ignore_eos": True}
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    wait_for(lambda: server.metric("rlt:kv_blocks_used") == 0)


def _streams_then_drained(server, one, plan: list[tuple]) -> list[str]:  # type: ignore[no-untyped-def]
    """`one(client, *args)` for every args of `plan` at once through one async client; then
    every block comes back, nothing runs or waits, and the server is healthy."""

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1",
            api_key="x",
            max_retries=0,
            http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=250), timeout=300),
        )
        try:
            return await asyncio.gather(*(one(client, *p) for p in plan))
        finally:
            await client.close()

    results = asyncio.run(main())
    wait_for(lambda: server.metric("rlt:kv_blocks_used") == 0)
    wait_for(lambda: server.metric("vllm:num_requests_running") == 0)
    assert server.metric("vllm:num_requests_waiting") == 0
    assert httpx.get(server.url + "/health").status_code == 200
    return results


def test_200_concurrent_streams_with_random_aborts(server) -> None:
    rng = random.Random(0)
    plan = [(i, rng.random() < 0.3, rng.randint(1, 6), rng.randint(4, 24)) for i in range(200)]

    async def one(client, i: int, abort: bool, after: int, max_tokens: int) -> str:  # type: ignore[no-untyped-def]
        stream = await client.completions.create(
            model="demo",
            prompt=f"Q: {i} + {i} =\nA:",
            max_tokens=max_tokens,
            temperature=0.8,
            seed=i,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        tokens, finish = 0, None
        async for chunk in stream:
            for choice in chunk.choices:
                tokens += len((choice.model_extra or {}).get("token_ids", []))
                finish = choice.finish_reason or finish
            if abort and tokens >= after:
                await stream.close()
                return "aborted"
        assert finish == "length" and tokens == max_tokens, (i, finish, tokens)
        return "done"

    results = _streams_then_drained(server, one, plan)
    assert results.count("done") >= 100 and set(results) <= {"done", "aborted"}


def test_concurrent_constrained_scored_and_free_streams_with_aborts(server) -> None:
    """The features that hold rows or score prompts, side by side under load: grammars
    (choice, regex, JSON object), prompt logprobs, min_tokens and free rows, some streams
    closed mid-way. Finished grammars hold; every block comes back."""
    rng = random.Random(1)
    kinds = [
        {"structured_outputs": {"choice": ["yes", "no"]}},
        {"structured_outputs": {"regex": "[a-z ]{1,12}"}},
        {"response_format": {"type": "json_object"}},
        {"prompt_logprobs": 1},
        {"min_tokens": 6},
        {},
    ]
    plan = [(i, kinds[i % len(kinds)], rng.random() < 0.3) for i in range(36)]

    async def one(client, i: int, extra: dict, abort: bool) -> str:  # type: ignore[no-untyped-def]
        stream = await client.completions.create(
            model="demo", prompt=f"Q: {i} + {i} =\nA:", max_tokens=16, temperature=0.8,
            seed=i, stream=True, extra_body=extra,
        )  # fmt: skip
        text, finish, chunks = "", None, 0
        async for chunk in stream:
            chunks += 1
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
            if abort and chunks >= 2:
                await stream.close()
                return "aborted"
        if "structured_outputs" in extra and finish == "stop":
            spec = extra["structured_outputs"]
            assert text in spec.get("choice", [text]), text
            assert re.fullmatch(spec.get("regex", ".*"), text, re.S), text
        if "response_format" in extra and finish == "stop":
            assert isinstance(json.loads(text), dict), text
        return "done"

    results = _streams_then_drained(server, one, plan)
    assert results.count("done") >= 18 and set(results) <= {"done", "aborted"}


def test_a_fault_in_one_request_fails_only_that_one() -> None:
    proc = ServerProcess(*DEMO_ARGS, script=FAULT_SERVER).wait_healthy()
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
        results: dict[str, object] = {}

        def healthy(i: int) -> None:
            out = client.completions.create(
                model="demo", prompt=f"{i} + 1 =", max_tokens=30, temperature=0
            )
            results[f"ok{i}"] = out.choices[0].finish_reason

        def faulty() -> None:
            try:
                client.completions.create(
                    model="demo",
                    prompt="2 + 2 =",
                    max_tokens=30,
                    stop=[FAULT_MARKER],
                    # the fault fires at the fourth token: an early EOS must not end it first
                    extra_body={"ignore_eos": True},
                )
                results["fault"] = "no error"
            except openai.InternalServerError as exc:
                results["fault"] = exc.status_code

        threads = [threading.Thread(target=healthy, args=(i,)) for i in range(4)]
        threads.append(threading.Thread(target=faulty))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results.pop("fault") == 500
        assert set(results.values()) <= {"length", "stop"} and len(results) == 4
        # streamed: the failure arrives in-band, then [DONE]
        body = {"model": "demo", "prompt": "3", "max_tokens": 30, "stream": True}
        body |= {"stop": [FAULT_MARKER], "ignore_eos": True}
        with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=60) as r:
            events = [line for line in r.iter_lines() if line]
        assert '"code":500' in events[-2] and events[-1] == "data: [DONE]"
        assert proc.metric("rlt:kv_blocks_used") == 0
        assert proc.metric("vllm:request_success_total") >= 5
        again = client.completions.create(model="demo", prompt="5", max_tokens=4)
        assert again.choices[0].finish_reason in ("length", "stop")
        assert httpx.get(proc.url + "/health").status_code == 200
    finally:
        proc.stop()


def test_sigterm_drains_running_requests() -> None:
    proc = ServerProcess(*DEMO_ARGS).wait_healthy()
    body = {"model": "demo", "prompt": "1", "max_tokens": 300, "ignore_eos": True, "stream": True}
    got: dict[str, object] = {}
    first = threading.Event()

    def stream() -> None:
        tokens = []
        with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                first.set()
                tokens.append(line)
        got["events"] = [t for t in tokens if t]

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert first.wait(60)
        assert proc.terminate(timeout=120) == 0
        t.join(60)
        events = got["events"]
        assert events[-1] == "data: [DONE]"  # the running request finished first
        assert '"finish_reason":"length"' in events[-2]
    finally:
        proc.stop()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_process_group_drains_and_leaves_no_process(sig) -> None:
    """Ctrl-C in a terminal, or SIGTERM from systemd (KillMode=control-group), reaches the
    server and its engine process at once: the engine process ignores it, the server drains
    the running request, stops the engine, and exits 0 (a stop asked for); no process of it
    is left."""
    proc = ServerProcess(*DEMO_ARGS, new_session=True).wait_healthy()
    kids = children(proc.proc.pid)
    assert proc.engine_pid() in kids
    body = {"model": "demo", "prompt": "1", "max_tokens": 300, "ignore_eos": True, "stream": True}
    got: dict[str, list[str]] = {}
    first = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=120) as r:
            got["events"] = []
            for line in r.iter_lines():
                first.set()
                if line:
                    got["events"].append(line)

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert first.wait(60)
        os.killpg(proc.proc.pid, sig)
        assert proc.proc.wait(120) == 0, proc.output()
        t.join(60)
        events = got["events"]
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
        wait_for(lambda: not any(running(k) for k in kids))
    finally:
        proc.stop()


def test_a_dead_engine_process_is_503_not_a_hang() -> None:
    """The engine process killed mid-stream (the OOM killer, a crashed kernel): the open stream
    ends with an in-band 503 and [DONE], /health is 503 with the exit code, new requests get
    503, and the server still stops cleanly."""
    proc = ServerProcess(*DEMO_ARGS).wait_healthy()
    try:
        body = {"model": "demo", "prompt": "1", "max_tokens": 1500, "ignore_eos": True}
        with httpx.stream(
            "POST", proc.url + "/v1/completions", json=body | {"stream": True}, timeout=60
        ) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            os.kill(proc.engine_pid(), signal.SIGKILL)
            events = [line for line in lines if line]
        assert '"code":503' in events[-2] and events[-1] == "data: [DONE]"
        health = httpx.get(proc.url + "/health", timeout=10)
        assert health.status_code == 503 and "exit code -9" in health.json()["error"]["message"]
        again = httpx.post(proc.url + "/v1/completions", json=body, timeout=10)
        assert again.status_code == 503
    finally:
        proc.stop()
    assert proc.proc.returncode is not None
