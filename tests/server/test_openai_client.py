"""The official `openai` client against a real `rlt serve` (demo model, CPU, loopback port):
completions and chat, streaming and not, sync and async, n > 1, stop, logprobs, seeds, the
looped-model extensions — and greedy outputs equal to the in-process `LLM` token for token."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

from rlt_engine import SamplingParams
from rlt_engine.sampling_params import StructuredOutput

PROMPTS = ["Q: Tom has 3 apples and buys 4 more. How many apples?\nA:", "Q: 12 - 5 =\nA:"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completion_greedy_equals_in_process(client, demo_llm) -> None:
    got = client.completions.create(model="demo", prompt=PROMPTS, max_tokens=20, temperature=0)
    want = demo_llm.generate(PROMPTS, SamplingParams(max_tokens=20))
    assert [c.index for c in got.choices] == [0, 1]
    for choice, out in zip(got.choices, want, strict=True):
        extra = choice.model_extra or {}
        assert extra["token_ids"] == out.token_ids
        assert extra["exit_depths"] == out.exit_depths
        assert choice.text == out.text
        assert choice.finish_reason == out.finish_reason
    assert got.usage.completion_tokens == sum(len(o.token_ids) for o in want)
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)


def test_chat_greedy_equals_in_process(client, demo_llm) -> None:
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    got = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=16, temperature=0
    )
    (want,) = demo_llm.chat(messages, SamplingParams(max_tokens=16))
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert (got.choices[0].model_extra or {})["token_ids"] == want.token_ids
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_penalties_equal_in_process(client, demo_llm) -> None:
    """presence / frequency (OpenAI's) and repetition_penalty (vLLM's, in the body) reach the
    engine: the tokens are the in-process engine's with the same penalties, and not those
    without them."""
    penalties = dict(presence_penalty=0.7, frequency_penalty=1.2)
    got = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=24,
        temperature=0,
        extra_body={"repetition_penalty": 1.3},
        **penalties,
    )
    params = SamplingParams(max_tokens=24, repetition_penalty=1.3, **penalties)
    (want,) = demo_llm.chat([{"role": "user", "content": PROMPTS[0]}], params)
    (plain,) = demo_llm.chat(
        [{"role": "user", "content": PROMPTS[0]}], SamplingParams(max_tokens=24)
    )
    assert (got.choices[0].model_extra or {})["token_ids"] == want.token_ids
    assert got.choices[0].message.content == want.text
    assert want.token_ids != plain.token_ids


def test_logit_bias_equals_in_process(client, demo_llm) -> None:
    """A bias of -100 keeps the greedy tokens out; +100 on one token makes it every token."""
    (plain,) = demo_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8))
    banned = {str(t): -100 for t in set(plain.token_ids)}
    got = client.completions.create(
        model="demo", prompt=PROMPTS[0], max_tokens=8, temperature=0, logit_bias=banned
    )
    ids = (got.choices[0].model_extra or {})["token_ids"]
    params = SamplingParams(max_tokens=8, logit_bias={int(t): -100 for t in banned})
    (want,) = demo_llm.generate([PROMPTS[0]], params)
    assert ids == want.token_ids and not set(ids) & set(plain.token_ids)
    forced = client.completions.create(
        model="demo", prompt=PROMPTS[0], max_tokens=3, temperature=0.8, logit_bias={"300": 100}
    )
    assert (forced.choices[0].model_extra or {})["token_ids"] == [300, 300, 300]


def test_min_tokens_equals_in_process(client, demo_llm) -> None:
    """vLLM's min_tokens (in the body) carries the answer past its end-of-turn token, to the
    in-process engine's tokens with the same min_tokens."""
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    (plain,) = demo_llm.chat(messages, SamplingParams(max_tokens=80))
    assert plain.finish_reason == "stop"
    n = len(plain.token_ids) + 5
    got = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=80, temperature=0, extra_body={"min_tokens": n}
    )
    (want,) = demo_llm.chat(messages, SamplingParams(max_tokens=80, min_tokens=n))
    ids = (got.choices[0].model_extra or {})["token_ids"]
    assert ids == want.token_ids and len(ids) >= n
    assert got.choices[0].message.content == want.text


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "maximum": 100}, "unit": {"enum": ["a", "b"]}},
    "required": ["answer", "unit"],
}


def test_json_schema_response_format_equals_in_process(client, demo_llm) -> None:
    """OpenAI's response_format json_schema: the content parses and follows the schema, and
    its tokens are the in-process engine's with the same grammar."""
    messages = [{"role": "user", "content": PROMPTS[0]}]
    got = client.chat.completions.create(
        model="demo",
        messages=messages,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    )
    content = got.choices[0].message.content
    answer = json.loads(content)
    assert set(answer) == {"answer", "unit"} and answer["unit"] in ("a", "b")
    params = SamplingParams(max_tokens=40, structured=StructuredOutput(json=SCHEMA))
    (want,) = demo_llm.chat(messages, params)
    assert (got.choices[0].model_extra or {})["token_ids"] == want.token_ids
    assert content == want.text and got.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "body",
    [
        {"structured_outputs": {"choice": ["yes", "no"]}},  # vLLM's
        {"guided_choice": ["yes", "no"]},  # vLLM's older name
    ],
)
def test_vllm_structured_outputs_stream_a_choice(client, body) -> None:
    stream = client.completions.create(
        model="demo", prompt=PROMPTS[1], max_tokens=8, temperature=0.7, seed=3, stream=True,
        extra_body=body,
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) in ("yes", "no")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_and_regex(client) -> None:
    got = client.completions.create(
        model="demo", prompt=PROMPTS[0], max_tokens=30, temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{1,3} apples"}},
    )  # fmt: skip
    assert re.fullmatch("[0-9]{1,3} apples", got.choices[0].text)
    got = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Give me JSON."}], max_tokens=40,
        temperature=0, response_format={"type": "json_object"},
    )  # fmt: skip
    content = got.choices[0].message.content
    assert content.startswith("{")
    if got.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, demo_llm) -> None:
    """lm-eval-harness's loglikelihood request (echo, logprobs=1, max_tokens=1, temperature
    0): the prompt's tokens with their logprobs (the first null) then the generated one's,
    text offsets through the echoed text; the values are the in-process engine's."""
    got = client.completions.create(
        model="demo", prompt=PROMPTS, max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    want = demo_llm.generate(PROMPTS, SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1))
    for choice, out, prompt in zip(got.choices, want, PROMPTS, strict=True):
        lp = choice.logprobs
        n = len(out.prompt_token_ids)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for got_lp, want_lp in zip(lp.token_logprobs[1:n], out.prompt_logprobs[1:], strict=True):
            assert got_lp == pytest.approx(want_lp.logprob, abs=1e-5)
        assert lp.token_logprobs[n] == pytest.approx(out.logprobs[0].logprob, abs=1e-5)
        assert choice.text == prompt + out.text
        assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(prompt)
        assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    # streamed: the first chunk opens with the prompt's entries
    stream = client.completions.create(
        model="demo", prompt=PROMPTS[0], max_tokens=3, logprobs=1, echo=True, temperature=0,
        stream=True,
    )  # fmt: skip
    entries = [
        value
        for chunk in stream
        for choice in chunk.choices
        for value in (choice.logprobs.token_logprobs if choice.logprobs else [])
    ]
    n = len(want[0].prompt_token_ids)
    assert len(entries) == n + 3 and entries[0] is None
    assert entries[1:n] == pytest.approx([p.logprob for p in want[0].prompt_logprobs[1:]], abs=1e-5)


def test_vllm_prompt_logprobs_field(client, demo_llm) -> None:
    """vLLM's prompt_logprobs: per prompt token (null for the first) its own entry and the
    top k's by token id, with logprob, rank and text; on completions per choice, on chat at
    the response's top level."""
    got = client.completions.create(
        model="demo", prompt=PROMPTS[1], max_tokens=2, temperature=0,
        extra_body={"prompt_logprobs": 2},
    )  # fmt: skip
    (want,) = demo_llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2, prompt_logprobs=2))
    scored = (got.choices[0].model_extra or {})["prompt_logprobs"]
    assert len(scored) == len(want.prompt_token_ids) and scored[0] is None
    for entry, lp in zip(scored[1:], want.prompt_logprobs[1:], strict=True):
        own = entry[str(lp.token_id)]
        assert own["rank"] == lp.rank and own["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
        assert own["decoded_token"] == demo_llm.engine.tokenizer.decode([lp.token_id])
        tops = sorted((v["rank"], int(t)) for t, v in entry.items() if v["rank"] <= 2)
        assert [t for _, t in tops] == [t for t, _ in lp.top]
    chat = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    entries = (chat.model_extra or {})["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])
    assert chat.usage.prompt_tokens == len(entries)


def test_continue_final_message_goes_on_with_the_assistants_text(client, demo_llm) -> None:
    """vLLM's continue_final_message: the last (assistant) message is left open and the
    answer continues it; the prompt is the template's text up to it, nothing after."""
    from rlt_engine.models.tokenizer import render_chat

    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "The answer is"},
    ]
    got = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=8, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    ids = render_chat(
        demo_llm.engine.tokenizer, messages, add_generation_prompt=False,
        continue_final_message=True,
    )  # fmt: skip
    assert demo_llm.engine.tokenizer.decode(ids).endswith("assistant\nThe answer is")
    (want,) = demo_llm.generate([ids], SamplingParams(max_tokens=8))
    (chat,) = demo_llm.chat(
        messages, SamplingParams(max_tokens=8), add_generation_prompt=False,
        continue_final_message=True,
    )  # fmt: skip
    assert chat.token_ids == want.token_ids
    assert (got.choices[0].model_extra or {})["token_ids"] == want.token_ids
    assert got.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(
            model="demo", messages=messages, max_tokens=2,
            extra_body={"continue_final_message": True},  # with a generation prompt
        )  # fmt: skip


def test_include_stop_str_and_special_tokens(client, demo_llm) -> None:
    """vLLM's include_stop_str_in_output keeps the stop string; skip_special_tokens false
    with it keeps the end-of-turn token's text, which is otherwise left out."""
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    args = dict(model="demo", messages=messages, max_tokens=60, temperature=0)
    cut = client.chat.completions.create(**args, stop=["="])
    kept = client.chat.completions.create(
        **args, stop=["="], extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].message.content == cut.choices[0].message.content + "="
    ended = client.chat.completions.create(
        **args, extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True}
    )
    (want,) = demo_llm.chat(messages, SamplingParams(max_tokens=60))
    assert want.finish_reason == "stop"
    assert ended.choices[0].message.content == want.text + "<|im_end|>"


def test_token_id_prompts_and_loop_controls(client, demo_llm) -> None:
    ids = demo_llm.tokenizer.encode(PROMPTS[1])
    controls = {"max_loops": 2, "exit_threshold": 1.0}
    got = client.completions.create(
        model="demo", prompt=[ids, ids[:-1]], max_tokens=8, temperature=0, extra_body=controls
    )
    want = demo_llm.generate([ids, ids[:-1]], SamplingParams(max_tokens=8, **controls))
    for choice, out in zip(got.choices, want, strict=True):
        assert (choice.model_extra or {})["token_ids"] == out.token_ids
        depths = (choice.model_extra or {})["exit_depths"]
        assert depths == out.exit_depths and set(depths[1:]) == {2}  # the first: from prefill


def test_streaming_completion_matches_non_streaming(client) -> None:
    args = dict(model="demo", prompt=PROMPTS[0], max_tokens=24, temperature=0)
    whole = client.completions.create(**args)
    pieces, tokens, finish = [], [], None
    stream = client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            tokens += (choice.model_extra or {}).get("token_ids", [])
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].text
    assert tokens == (whole.choices[0].model_extra or {})["token_ids"]
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_streaming_chat_has_role_then_content(client) -> None:
    messages = [{"role": "user", "content": "Count: 1, 2, 3"}]
    args = dict(model="demo", messages=messages, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n_choices_and_seed_reproducible(client) -> None:
    args = dict(model="demo", prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=7, n=3)
    a = client.completions.create(**args)
    b = client.completions.create(**args)
    ids = [(c.model_extra or {})["token_ids"] for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert ids == [(c.model_extra or {})["token_ids"] for c in b.choices]
    assert len({tuple(i) for i in ids}) > 1  # seed + choice index: different samples
    other = client.completions.create(**{**args, "seed": 8})
    assert [(c.model_extra or {})["token_ids"] for c in other.choices] != ids


def test_stop_string(client) -> None:
    free = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=24, temperature=0)
    text = free.choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    got = client.completions.create(
        model="demo", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop]
    )
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == text[: text.index(stop)]


def test_logprobs(client, demo_llm) -> None:
    got = client.completions.create(
        model="demo", prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3
    )
    (want,) = demo_llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, logprobs=3))
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-5)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.tokens == [demo_llm.tokenizer.decode([t]) for t in want.token_ids]
    chat = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_echo(client) -> None:
    got = client.completions.create(
        model="demo", prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True
    )
    assert got.choices[0].text.startswith(PROMPTS[1])


def test_async_client_concurrent_streams(server, demo_llm) -> None:
    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

        async def one(prompt: str) -> str:
            stream = await client.completions.create(
                model="demo", prompt=prompt, max_tokens=10, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS * 4))
        finally:
            await client.close()

    texts = asyncio.run(main())
    want = [o.text for o in demo_llm.generate(PROMPTS, SamplingParams(max_tokens=10))]
    assert texts == want * 4


def test_models_health_version(client, server) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"]
    assert (models.data[0].model_extra or {})["num_loops"] == 4
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_raw_sse_framing(server) -> None:
    body = {"model": "demo", "prompt": "1, 2,", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_openai_errors_are_typed(client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt="x", max_tokens=2, temperature=-1)
    assert info.value.body["param"] == "temperature"


def test_stream_interval_sends_fewer_larger_chunks(client) -> None:
    """`--stream-interval 4`: chunks of at least 4 tokens after the first (the last holds the
    rest), the text and token ids of the default server's stream. That the first token is not
    held is `test_stream_interval_gathers_tokens_before_delivery`'s to check: over HTTP,
    a server whose event loop reads late merges the first delta with the next, whatever the
    interval, and the engine process runs ahead of it."""
    from server_process import DEMO_ARGS, ServerProcess

    args = dict(model="demo", prompt=PROMPTS[0], max_tokens=17, temperature=0,
                extra_body={"ignore_eos": True})  # fmt: skip

    def stream(c: openai.OpenAI) -> tuple[list[int], str, list[int]]:
        sizes, tokens, text = [], [], ""
        for chunk in c.completions.create(**args, stream=True):
            for choice in chunk.choices:
                ids = (choice.model_extra or {}).get("token_ids", [])
                if ids:
                    sizes.append(len(ids))
                tokens += ids
                text += choice.text
        return tokens, text, sizes

    tokens, text, sizes = stream(client)
    proc = ServerProcess(*DEMO_ARGS, "--stream-interval", "4").wait_healthy()
    try:
        gathered = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
        tokens4, text4, sizes4 = stream(gathered)
    finally:
        proc.stop()
    assert (tokens4, text4) == (tokens, text) and len(tokens) == 17
    assert all(n >= 4 for n in sizes4[1:-1])
    assert len(sizes4) < len(sizes)
