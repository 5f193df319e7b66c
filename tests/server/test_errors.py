"""Every error status of the API, with an OpenAI-style body that names the field."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_process import DEMO_ARGS, ServerProcess


def _post(server, path: str, body: object, **kw) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "demo", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "demo", "prompt": "x", "temperature": "hot"}, "temperature"),
        ({"model": "demo", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "demo", "prompt": "x", "logprobs": 21}, "logprobs"),
        ({"model": "demo", "prompt": "x", "n": 0}, "n"),
        ({"model": "demo", "prompt": "x", "stop": [""]}, "stop"),
        ({"model": "demo", "prompt": "x", "min_loops": 3, "max_loops": 2}, "min_loops"),
        ({"model": "demo", "prompt": "x", "max_loops": 9}, "prompt"),  # past the model depth
        ({"model": "demo", "prompt": "x", "exit_threshold": 1.5}, "exit_threshold"),
        ({"model": "demo", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"model": "demo", "prompt": "x", "frequency_penalty": "hot"}, "frequency_penalty"),
        ({"model": "demo", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"model": "demo", "prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"model": "demo", "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"model": "demo", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"model": "demo", "prompt": "x", "min_tokens": 17}, "min_tokens"),  # default max: 16
        ({"model": "demo", "prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
        (
            {"model": "demo", "prompt": "x", "response_format": {"type": "json_schema"}},
            "response_format",
        ),
        ({"model": "demo", "prompt": "x", "guided_regex": "(("}, "guided_regex"),  # compiles not
        (
            {"model": "demo", "prompt": "x", "structured_outputs": {"json": {"type": "nonsense"}}},
            "structured_outputs",
        ),
        (
            {"model": "demo", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
        ),
        (
            {"model": "demo", "prompt": "x", "structured_outputs": {"xml": "a"}},
            "structured_outputs",
        ),
        (
            {"model": "demo", "prompt": "x", "guided_regex": "a", "guided_choice": ["a"]},
            "guided_regex",
        ),
        ({"model": "demo", "prompt": "x", "guided_regex": "a", "ignore_eos": True}, "prompt"),
        ({"model": "demo", "prompt": "x", "guided_regex": "a", "min_tokens": 2}, "min_tokens"),
        ({"model": "demo", "prompt": "x", "logit_bias": {"50": 101}}, "logit_bias"),
        ({"model": "demo", "prompt": "x", "logit_bias": {"fifty": 5}}, "logit_bias"),
        ({"model": "demo", "prompt": "x", "logit_bias": {"-1": 5}}, "logit_bias"),
        ({"model": "demo", "prompt": "x", "logit_bias": {str(10**9): 5}}, "logit_bias"),  # vocab
        ({"model": "demo", "prompt": []}, "prompt"),
        ({"model": "demo", "prompt": [-1, 2]}, None),
        ({"model": "demo", "prompt": [10**9]}, "prompt"),  # outside the vocabulary
        ({"prompt": "x"}, "model"),
        ({"model": "demo", "prompt": "x", "stream_options": {"include_usage": True}}, None),
    ],
)
def test_completions_400_names_the_field(server, body, param) -> None:
    _error(_post(server, "/v1/completions", body), 400, param)


def test_chat_400(server) -> None:
    _error(
        _post(server, "/v1/chat/completions", {"model": "demo", "messages": []}), 400, "messages"
    )
    bad_role = {"model": "demo", "messages": [{"role": "robot", "content": "x"}]}
    _error(_post(server, "/v1/chat/completions", bad_role), 400)
    no_logprobs = {"model": "demo", "messages": [{"role": "user", "content": "x"}]}
    _error(_post(server, "/v1/chat/completions", {**no_logprobs, "top_logprobs": 2}), 400)


def test_chat_refuses_tools_it_cannot_honour(server) -> None:
    """Asked for a tool call, the server says it cannot instead of answering free text; the
    forms that ask for nothing it lacks still answer."""
    chat = {"model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for extra, param in (
        ({"tools": [tool]}, "tools"),
        ({"tools": [tool], "tool_choice": "auto"}, "tools"),
        ({"tools": [tool], "tool_choice": "required"}, "tools"),
        ({"functions": [tool["function"]]}, "functions"),
    ):
        _error(_post(server, "/v1/chat/completions", {**chat, **extra}), 400, param)
    for extra in (
        {"tools": [tool], "tool_choice": "none"},
        {"tools": []},
        {"response_format": {"type": "text"}},
        {"logit_bias": {}},
    ):
        r = _post(server, "/v1/chat/completions", {**chat, **extra})
        assert r.status_code == 200, (extra, r.text)


def test_not_json_and_wrong_method(server) -> None:
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30)
    _error(r, 400)
    assert httpx.get(server.url + "/v1/completions").status_code == 405


def test_prompt_too_long_is_400_not_a_hang(server) -> None:
    r = _post(server, "/v1/completions", {"model": "demo", "prompt": "hi " * 3000, "max_tokens": 4})
    assert "context" in _error(r, 400, "prompt")["message"]
    r = _post(server, "/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 10**6})
    _error(r, 400, "prompt")


def test_unknown_model_404(server) -> None:
    _error(_post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404, "model")
    chat = {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
    _error(_post(server, "/v1/chat/completions", chat), 404, "model")


def test_body_over_the_limit_413(server) -> None:
    big = {"model": "demo", "prompt": "x" * (17 << 20)}
    _error(_post(server, "/v1/completions", big), 413)

    def chunks():  # no Content-Length: counted while it streams in
        yield b'{"model": "demo", "prompt": "'
        for _ in range(17):
            yield b"x" * (1 << 20)
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60)
    _error(r, 413)
    assert httpx.get(server.url + "/health").status_code == 200


def test_api_key() -> None:
    proc = ServerProcess(*DEMO_ARGS, env={"RLT_API_KEY": "sekret"}).wait_healthy()
    try:
        body = {"model": "demo", "prompt": "1 2", "max_tokens": 2}
        _error(_post(proc, "/v1/completions", body), 401)
        _error(_post(proc, "/v1/completions", body, headers={"Authorization": "Bearer no"}), 401)
        assert httpx.get(proc.url + "/v1/models").status_code == 401
        ok = _post(proc, "/v1/completions", body, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert httpx.get(proc.url + "/health").status_code == 200  # open, as in vLLM
        assert httpx.get(proc.url + "/metrics").status_code == 200
    finally:
        proc.stop()


def test_over_max_concurrent_requests_429() -> None:
    proc = ServerProcess(*DEMO_ARGS, "--max-concurrent-requests", "1").wait_healthy()
    try:
        long = {"model": "demo", "prompt": "1", "max_tokens": 200, "ignore_eos": True}
        started = threading.Event()

        def hold() -> None:
            body = {**long, "stream": True}
            with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    started.set()

        holder = threading.Thread(target=hold)
        holder.start()
        assert started.wait(60)
        r = _post(proc, "/v1/completions", {"model": "demo", "prompt": "2", "max_tokens": 2})
        _error(r, 429)
        assert r.headers["retry-after"] == "1"
        holder.join(120)
        assert _post(proc, "/v1/completions", {"model": "demo", "prompt": "2"}).status_code == 200
    finally:
        proc.stop()


def test_slot_free_once_the_client_has_read_the_end() -> None:
    """Closed-loop clients at the limit send their next request as soon as they have read
    the last event; none may meet its predecessor's slot. They did: the slot came back a few
    event loop turns after the last event went out, and clients at c=256 against the default
    limit of 256 got 429 for a third of their requests."""
    from rlt_engine.bench.serving import ServingBenchConfig, benchmark

    limit = 32
    proc = ServerProcess(*DEMO_ARGS, "--max-concurrent-requests", str(limit)).wait_healthy()
    try:
        config = ServingBenchConfig(
            proc.url, num_prompts=8 * limit, max_concurrency=limit, input_len=4, output_len=2
        )
        report = benchmark(config)
        assert report["errors"] == {}
        assert report["completed"] == config.num_prompts
    finally:
        proc.stop()


def test_request_timeout_408() -> None:
    proc = ServerProcess(*DEMO_ARGS, "--request-timeout", "0.5").wait_healthy()
    try:
        long = {"model": "demo", "prompt": "1", "max_tokens": 2000, "ignore_eos": True}
        _error(_post(proc, "/v1/completions", long), 408)
        with httpx.stream(
            "POST", proc.url + "/v1/completions", json={**long, "stream": True}, timeout=60
        ) as r:
            events = [line for line in r.iter_lines() if line]
        assert '"code":408' in events[-2] and events[-1] == "data: [DONE]"
        # the abort reaches the engine on its next turn
        for _ in range(100):
            if proc.metric("rlt:kv_blocks_used") == 0:
                break
            time.sleep(0.05)
        assert proc.metric("rlt:kv_blocks_used") == 0
    finally:
        proc.stop()


def test_bad_flags_fail_fast() -> None:
    import subprocess
    import sys

    for args, flag in (
        (["--port", "70000"], "port"),
        (["--request-timeout", "0"], "timeout"),
        (["--stream-interval", "0"], "stream-interval"),
        (["--api-server-count", "0"], "api-server-count"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "rlt_cli.main", "serve", "demo", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode != 0
        assert flag in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_missing_model_is_one_line(tmp_path) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "rlt_cli.main", "serve", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "nothing" in out.stderr


def test_broken_checkpoint_exits_with_one_line(tmp_path) -> None:
    """A checkpoint that fails while loading (in the engine process) stops the server."""
    import shutil
    import subprocess
    import sys

    from rlt_engine.checkpoints.aliases import DEMO_DIR

    broken = tmp_path / "broken"
    shutil.copytree(DEMO_DIR, broken)
    (broken / "model.safetensors").write_bytes(b"garbage")
    out = subprocess.run(
        [sys.executable, "-m", "rlt_cli.main", "serve", str(broken), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert "model.safetensors" in out.stderr.strip().splitlines()[-1]
