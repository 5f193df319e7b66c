"""`rlt serve` grows KV pages as requests advance (incremental KV with preemption, its default):
chat requests that leave max_tokens out, so that each may run to the end of the context, still
run side by side. Reserving each request's whole lifetime at admission let one of them hold the
demo model's pool (2,048 positions x 4 planes = 512 blocks) while the others waited."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import openai
import pytest
from server_process import DEMO_ARGS, ServerProcess

QUESTIONS = [
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "A box holds 12 pens. How many pens are in 3 boxes?",
    "Sara had 20 dollars and spent 8. How much is left?",
]


async def _stream(client: openai.AsyncOpenAI, question: str) -> tuple[float, float, str]:
    """(when the first content arrived, when the stream ended, finish reason): no max_tokens."""
    stream = await client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": question}],
        temperature=0,
        stream=True,
    )
    first, finish = None, None
    async for chunk in stream:
        choice = chunk.choices[0]
        if first is None and choice.delta.content:
            first = time.monotonic()
        finish = choice.finish_reason or finish
    assert first is not None and finish is not None
    return first, time.monotonic(), finish


def test_chat_without_max_tokens_runs_side_by_side(server) -> None:  # type: ignore[no-untyped-def]
    async def run() -> list[tuple[float, float, str]]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            return await asyncio.gather(*(_stream(client, q) for q in QUESTIONS))

    done = asyncio.run(run())
    assert all(finish == "stop" for _, _, finish in done)
    # every request was producing tokens before the first of them ended: with each reserving
    # its whole context, the second could only start once the first had ended
    assert max(first for first, _, _ in done) < min(end for _, end, _ in done)
    assert server.metric("rlt:kv_blocks_used") == 0  # every page given back


async def _answers(url: str, questions: list[str], max_tokens: int | None) -> list[tuple]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as c:
        got = await asyncio.gather(
            *(
                c.chat.completions.create(
                    model="demo",
                    messages=[{"role": "user", "content": q}],
                    temperature=0,
                    max_tokens=max_tokens,
                )
                for q in questions
            )
        )
    return [(r.choices[0].message.content, r.choices[0].finish_reason) for r in got]


@pytest.fixture(scope="module")
def tight():  # type: ignore[no-untyped-def]
    """A server whose pool holds 64 blocks: 256 positions of the demo's 4 planes, far less
    than its 2,048-position context."""
    proc = ServerProcess(*DEMO_ARGS, "--num-blocks", "64").wait_healthy()
    yield proc
    proc.stop()


def test_chat_without_max_tokens_fits_the_pool(tight) -> None:  # type: ignore[no-untyped-def]
    # the rest of the context would need 512 blocks: the default is what the pool can hold
    [(text, finish)] = asyncio.run(_answers(tight.url, QUESTIONS[:1], None))
    assert finish == "stop" and text


def test_preempted_requests_answer_as_unpressed_ones(server, tight) -> None:  # type: ignore[no-untyped-def]
    """Eight chats that each fit the tight pool alone (60 of 64 blocks at max_tokens 200) but
    not together: requests are preempted to CPU memory and resumed, and every answer equals
    the roomy server's."""
    questions = [f"Tom has {n} apples and buys 5 more. How many apples does he have?" for n in
                 range(3, 11)]  # fmt: skip
    before = tight.metric("vllm:num_preemptions_total")
    pressed = asyncio.run(_answers(tight.url, questions, 200))
    assert tight.metric("vllm:num_preemptions_total") > before
    assert pressed == asyncio.run(_answers(server.url, questions, 200))
    assert tight.metric("rlt:kv_blocks_used") == 0


def test_serve_lets_the_defaults_be_turned_off() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rlt_cli.main", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "200", "PATH": ""},
    )
    assert out.returncode == 0, out.stderr
    assert "--no-incremental-kv" in out.stdout and "--no-enable-preemption" in out.stdout


@pytest.fixture(scope="module")
def capped():  # type: ignore[no-untyped-def]
    """A server whose requests may take 96 positions of the demo's 2,048 (--max-model-len)."""
    proc = ServerProcess(*DEMO_ARGS, "--max-model-len", "96").wait_healthy()
    yield proc
    proc.stop()


def test_max_model_len_bounds_what_a_chat_may_run_to(capped) -> None:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=capped.url + "/v1", api_key="unused", max_retries=0)
    (card,) = client.models.list().data
    assert (card.model_extra or {})["max_model_len"] == 96
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    got = client.chat.completions.create(
        model="demo", messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    # no max_tokens: as vLLM, prompt and output fill the 96
    assert got.choices[0].finish_reason == "length"
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens == 96
    with pytest.raises(openai.BadRequestError, match="exceeds max_model_len=96") as refused:
        client.chat.completions.create(model="demo", messages=messages, max_tokens=200)
    assert refused.value.body["param"] == "messages"  # type: ignore[index]
    assert capped.metric("rlt:kv_blocks_used") == 0
