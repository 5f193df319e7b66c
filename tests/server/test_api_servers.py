"""`rlt serve --api-server-count 2`: two API server processes on one socket, one engine
process, the outputs of the in-process engine, metrics that count both servers' requests, a
drain on SIGTERM, a taken port and a model that fails to load in one line; no process left."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import httpx
from processes import children, running, spawned, wait_for
from server_process import DEMO_ARGS, ServerProcess

from rlt_engine import SamplingParams

PROMPTS = [f"Q: {i} + {i} =\nA:" for i in range(12)]


def test_two_api_servers_serve_count_and_drain(demo_llm) -> None:
    proc = ServerProcess(*DEMO_ARGS, "--api-server-count", "2").wait_healthy()
    try:
        # healthy = one server is ready; each takes connections once its own copy of the
        # tokenizer has loaded (the engine's gauges come from the first server)
        wait_for(lambda: proc.output().count("Application startup complete") == 2, 60)
        kids = children(proc.proc.pid)
        assert len(spawned(proc.proc.pid)) == 3  # the engine and two API servers
        results: dict[int, list[int]] = {}

        def one(i: int) -> None:
            # a connection each (closed after), so the kernel spreads them over the servers
            body = {"model": "demo", "prompt": PROMPTS[i], "max_tokens": 6, "temperature": 0}
            r = httpx.post(proc.url + "/v1/completions", json=body, timeout=120,
                           headers={"Connection": "close"})  # fmt: skip
            assert r.status_code == 200, r.text
            results[i] = r.json()["choices"][0]["token_ids"]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        want = demo_llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))
        assert [results[i] for i in range(len(PROMPTS))] == [o.token_ids for o in want]
        tokens = sum(len(ids) for ids in results.values())
        # whichever server answers /metrics counts both servers' requests, the engine's once
        for _ in range(4):
            wait_for(lambda: proc.metric("vllm:generation_tokens_total") == tokens)
            assert proc.metric("vllm:request_success_total") == len(PROMPTS)
            assert proc.metric("rlt:kv_blocks_used") == 0
            assert proc.metric("rlt:kv_blocks_total") > 0

        # SIGTERM: a running stream finishes, then everything exits
        body = {"model": "demo", "prompt": "1", "max_tokens": 200, "ignore_eos": True,
                "stream": True}  # fmt: skip
        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    first.set()
                    if line:
                        events.append(line)

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        assert proc.terminate(timeout=150) == 0, proc.output()
        t.join(60)
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
        wait_for(lambda: not any(running(k) for k in kids))
    finally:
        proc.stop()


def test_a_taken_port_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "rlt_cli.main", "serve", "demo", "--device", "cpu",
             "--api-server-count", "2", "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 1
    assert f"--port {port}" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_model_that_fails_to_load_stops_every_process(tmp_path) -> None:
    """A checkpoint that fails in the engine process: each server says so, the command
    exits 1, and no process is left."""
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "ouro", "hidden_size": "wide"}')
    proc = ServerProcess(str(model), "--api-server-count", "2")
    try:
        assert proc.proc.wait(120) == 1, proc.output()
        assert "model failed to load" in proc.output()
        assert "Traceback" not in proc.output()
    finally:
        proc.stop()


def test_the_concurrency_limit_is_one_for_all_servers() -> None:
    """`--max-concurrent-requests 2` with two servers: while two long requests run, whichever
    server took them, a third gets 429 from either server; after them, one runs again."""
    proc = ServerProcess(*DEMO_ARGS, "--api-server-count", "2", "--max-concurrent-requests", "2")
    proc.wait_healthy()
    try:
        wait_for(lambda: proc.output().count("Application startup complete") == 2, 60)
        # long enough to outlast the checks, short enough for both to fit the KV pool at once
        body = {"model": "demo", "prompt": "1", "max_tokens": 300, "ignore_eos": True,
                "stream": True}  # fmt: skip
        started = [threading.Event(), threading.Event()]

        def hold(i: int) -> None:
            url = proc.url + "/v1/completions"
            # a client (a connection) each, read to the end
            with httpx.Client(timeout=120) as client, client.stream("POST", url, json=body) as r:
                for _ in r.iter_lines():
                    started[i].set()

        holders = [threading.Thread(target=hold, args=(i,)) for i in range(2)]
        for t in holders:
            t.start()
        assert all(e.wait(60) for e in started)
        small = {"model": "demo", "prompt": "2", "max_tokens": 2}
        codes = [httpx.post(proc.url + "/v1/completions", json=small, timeout=30,
                            headers={"Connection": "close"}).status_code
                 for _ in range(4)]  # fmt: skip
        holding = sum(t.is_alive() for t in holders)
        for t in holders:
            t.join(120)
        assert holding == 2 and codes == [429] * 4
        assert httpx.post(proc.url + "/v1/completions", json=small, timeout=30).status_code == 200
    finally:
        proc.stop()
