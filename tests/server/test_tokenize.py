"""vLLM's /tokenize and /detokenize on a real `rlt serve` (demo model): the ids a completion or
a chat request sends the engine, and back; bad input is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from rlt_engine.models.tokenizer import render_chat


def _post(server, path: str, body: object) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.post(server.url + path, json=body, timeout=60)


def test_tokenize_a_prompt_and_chat_messages_then_detokenize(server, demo_llm) -> None:
    tokenizer = demo_llm.engine.tokenizer
    r = _post(server, "/tokenize", {"model": "demo", "prompt": "Tom has 3 apples."})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode("Tom has 3 apples.")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    r = _post(server, "/tokenize", {"model": "demo", "messages": messages})
    assert r.json()["tokens"] == render_chat(tokenizer, messages)
    # the ids a chat completion counts as its prompt
    chat = _post(
        server, "/v1/chat/completions", {"model": "demo", "messages": messages, "max_tokens": 1}
    )
    assert chat.json()["usage"]["prompt_tokens"] == r.json()["count"]
    r = _post(server, "/detokenize", {"model": "demo", "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "Tom has 3 apples."}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "demo"}, 400, "prompt"),
        ("/tokenize", {"model": "demo", "prompt": "x", "messages": []}, 400, "prompt"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": "demo", "tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"model": "demo", "tokens": [-1]}, 400, "tokens.0"),
    ],
)
def test_bad_tokenize_requests_name_the_field(server, path, body, status, param) -> None:
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
