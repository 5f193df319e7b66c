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
