"""AsyncEngine (the engine on a thread or in its own process, asyncio callers) against the
synchronous LLM: the same tokens, deltas that add up to the final output, aborts that free
everything, one request's fault failing that request alone, a clean shutdown, and an engine
process that dies or is orphaned."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from processes import running

from rlt_engine import LLM, SamplingParams
from rlt_engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineNotReadyError,
    RequestFailedError,
    RequestStream,
    StepReport,
)
from rlt_engine.config import EngineConfig
from rlt_engine.detokenizer import IncrementalDetokenizer
from rlt_engine.engine import LLMEngine
from rlt_engine.engine_core import CoreTurn
from rlt_engine.outputs import RequestMetrics, RequestOutput, TokenLogprob

PROMPTS = ["Q: 1 + 2 =\nA:", "Q: 7 - 3 =\nA:", "Q: 4 * 2 =\nA:", "Q: 9 / 3 =\nA:"]
OPTIONS = dict(dtype="float32", device="cpu", max_num_seqs=4, block_size=4)


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The synchronous reference (never stepped while an AsyncEngine owns `served`)."""
    return LLM("demo", **OPTIONS)


@pytest.fixture(scope="module")
def served() -> LLM:
    return LLM("demo", **OPTIONS)


@pytest.fixture
def engine(served):  # type: ignore[no-untyped-def]
    async_engine = AsyncEngine(lambda: served.engine)
    async_engine.start()
    assert async_engine.wait_ready(60)
    yield async_engine
    async_engine.shutdown()
    assert async_engine.status == "stopped", async_engine.error
    assert served.engine.blocks.num_used == 0 and not served.engine.has_unfinished_requests()


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=12, temperature=0.9, seed=i, logprobs=2)
    return SamplingParams(max_tokens=10 + i, stop=["\n"])


async def _run(engine: AsyncEngine, prompt: str, params: SamplingParams, rid: str) -> dict:
    deltas, tokens, depths, text = [], [], [], ""
    async for out in engine.generate(prompt, params, rid):
        deltas.append(out)
        tokens += out.new_token_ids
        depths += out.new_exit_depths
        text += out.new_text
    final = deltas[-1]
    assert final.finished and all(not d.finished for d in deltas[:-1])
    assert tokens == final.token_ids and depths == final.exit_depths and text == final.text
    assert [d.num_tokens for d in deltas] == sorted(d.num_tokens for d in deltas)
    return {"tokens": final.token_ids, "depths": final.exit_depths, "text": final.text}


def test_async_equals_sync_with_deltas(engine, llm) -> None:
    async def main() -> list[dict]:
        jobs = [_run(engine, p, _params(i), f"r{i}") for i, p in enumerate(PROMPTS * 2)]
        return await asyncio.gather(*jobs)

    got = asyncio.run(main())
    want = llm.generate(PROMPTS * 2, [_params(i) for i in range(8)])
    assert got == [{"tokens": o.token_ids, "depths": o.exit_depths, "text": o.text} for o in want]


def test_refused_request_and_abort(engine, llm) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="context"):
            await engine.add("x" * 100_000, SamplingParams(max_tokens=4), "too-long")
        stream = await engine.add(PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True), "a")
        first = await stream.__anext__()
        assert not first.finished
        stream.abort()
        stream.abort()  # idempotent
        ok = await _run(engine, PROMPTS[1], SamplingParams(max_tokens=5), "b")
        assert len(ok["tokens"]) <= 5

    asyncio.run(main())


def test_deltas_queued_while_the_caller_was_busy_come_out_as_one(engine, llm) -> None:
    """A caller that reads only after the request has finished (a server behind the engine)
    gets one output: every token, depth, logprob and the text of the steps it missed, the
    same as the synchronous engine's; a caller that keeps up gets one per step (above)."""
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=5, logprobs=2, ignore_eos=True)

    async def main() -> list[RequestOutput]:
        stream = await engine.add(PROMPTS[3], params, "late")
        for _ in range(500):  # until its last output has landed (the engine may be done with
            # the request a moment before its outputs reach the queue: CI saw 2 outputs there)
            await asyncio.sleep(0.01)
            queued = list(stream.queue._queue)  # (asyncio.Queue's deque: a look, no take)
            if queued and isinstance(queued[-1], RequestOutput) and queued[-1].finished:
                break
        assert stream.queue.qsize() >= 2  # several steps' deltas waited
        return [out async for out in stream]

    outs = asyncio.run(main())
    (want,) = llm.generate([PROMPTS[3]], params)
    assert len(outs) == 1 and outs[0].finished
    out = outs[0]
    assert out.new_token_ids == out.token_ids == want.token_ids
    assert out.new_exit_depths == want.exit_depths and out.new_text == want.text
    assert out.new_logprobs == out.logprobs == want.logprobs


def _delta(tokens: list[int], finished: bool = False, logprobs: bool = False) -> RequestOutput:
    lps = [TokenLogprob(t, -float(t), ()) for t in tokens] if logprobs else None
    return RequestOutput(
        "r", [1, 2], tokens, [4] * len(tokens), "".join(map(str, tokens)), lps,
        num_tokens=tokens[-1], finished=finished, finish_reason="length" if finished else None,
        metrics=RequestMetrics(0.0, 1.0, 2.0 if finished else None),
    )  # fmt: skip


def test_merged_deltas_stop_at_an_error_and_at_the_last_output() -> None:
    """An error queued behind outputs is raised after them, never merged away or early; a
    finished output ends the stream even if something was queued after it."""

    async def main() -> None:
        stream = RequestStream(AsyncEngine(lambda: None), "r")  # type: ignore[arg-type,return-value]
        for item in (_delta([1]), _delta([2], logprobs=True), RequestFailedError("gone")):
            stream.queue.put_nowait(item)
        first = await stream.__anext__()
        assert (first.new_token_ids, first.new_text, first.num_tokens) == ([1, 2], "12", 2)
        assert first.new_logprobs == [TokenLogprob(2, -2.0, ())]
        with pytest.raises(RequestFailedError, match="gone"):
            await stream.__anext__()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()

        ended = RequestStream(AsyncEngine(lambda: None), "r")  # type: ignore[arg-type,return-value]
        for item in (_delta([1]), _delta([2, 3], finished=True), _delta([9])):
            ended.queue.put_nowait(item)
        outs = [out async for out in ended]
        assert [(o.new_token_ids, o.finished, o.finish_reason) for o in outs] == [
            ([1, 2, 3], True, "length")
        ]

    asyncio.run(main())
    with pytest.raises(ValueError, match="several requests"):
        RequestOutput.merged([_delta([1]), dataclasses.replace(_delta([2]), request_id="x")])


def test_stream_interval_gathers_tokens_before_delivery() -> None:
    """With stream_interval 3 the delivering thread sends a request's first token at once, then
    outputs of at least 3 tokens, and the end with whatever it held; a step without tokens
    sends nothing; an error follows what was held. Interval 1 sends every step's output."""
    from rlt_engine.async_engine import _Route

    def deliver(interval: int, steps: list[RequestOutput]) -> list:
        engine = AsyncEngine(lambda: None, stream_interval=interval)  # type: ignore[arg-type,return-value]
        loop = asyncio.new_event_loop()
        try:
            queue: asyncio.Queue = asyncio.Queue()
            engine._state.streams["r"] = _Route(loop, queue)
            for out in steps:
                engine._on_turn(CoreTurn(outputs=[out]))
            loop.run_until_complete(asyncio.sleep(0))  # the posted puts run
            return [queue.get_nowait() for _ in range(queue.qsize())]
        finally:
            loop.close()

    none = dataclasses.replace(_delta([9]), new_token_ids=[], new_exit_depths=[], new_text="")
    steps = [none, _delta([1]), _delta([2]), _delta([3]), _delta([4, 5]), _delta([6]),
             _delta([7], finished=True)]  # fmt: skip
    got = deliver(3, steps)
    assert [(o.new_token_ids, o.finished) for o in got] == [
        ([1], False),  # the first token at once (the step before it had none: nothing sent)
        ([2, 3, 4, 5], False),
        ([6, 7], True),
    ]
    assert "".join(o.new_text for o in got) == "1234567"
    assert len(deliver(1, steps)) == len(steps)  # every step, as before
    failed = deliver(3, [_delta([1]), _delta([2]), dataclasses.replace(
        _delta([3], finished=True), finish_reason="error", error="boom")])  # fmt: skip
    assert [o.new_token_ids for o in failed[:1]] == [[1]] and failed[1].new_token_ids == [2]
    assert isinstance(failed[2], RequestFailedError) and "boom" in str(failed[2])
    with pytest.raises(ValueError, match="stream_interval"):
        AsyncEngine(lambda: None, stream_interval=0)  # type: ignore[arg-type,return-value]


def test_stream_interval_keeps_the_outputs(served, llm) -> None:
    """Served with stream_interval 4: the same tokens, depths and text as the synchronous
    engine, in fewer outputs, each after the first holding at least 4 tokens (or the end)."""
    engine = AsyncEngine(lambda: served.engine, stream_interval=4)
    engine.start()
    assert engine.wait_ready(60)
    counts: list[list[int]] = []

    async def run(i: int, prompt: str) -> dict:
        sizes: list[int] = []
        tokens: list[int] = []
        async for out in engine.generate(prompt, _params(i), f"s{i}"):
            sizes.append(len(out.new_token_ids))
            tokens += out.new_token_ids
            if out.finished:
                counts.append(sizes)
                return {"tokens": out.token_ids, "depths": out.exit_depths, "text": out.text}
        raise AssertionError("no finished output")

    async def main() -> list[dict]:
        return await asyncio.gather(*(run(i, p) for i, p in enumerate(PROMPTS)))

    try:
        got = asyncio.run(main())
    finally:
        engine.shutdown()
    want = llm.generate(PROMPTS, [_params(i) for i in range(4)])
    assert got == [{"tokens": o.token_ids, "depths": o.exit_depths, "text": o.text} for o in want]
    for sizes in counts:
        assert sizes[0] >= 1 and all(n >= 4 for n in sizes[1:-1]), sizes
    assert sum(len(c) for c in counts) < sum(sum(c) for c in counts)  # fewer outputs than tokens


def test_final_only_callers_get_one_output(engine, llm) -> None:
    """A caller that wants no deltas (a response sent whole) gets the finished output alone,
    its deltas joined on the engine thread: the synchronous engine's tokens, depths, text and
    logprobs; a streamed request beside it still gets its deltas (`_run` checks them)."""
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=5, logprobs=2, ignore_eos=True)

    async def main() -> tuple[list[RequestOutput], dict]:
        whole = await engine.add(PROMPTS[3], params, "whole", final_only=True)
        streamed = asyncio.ensure_future(_run(engine, PROMPTS[0], _params(0), "streamed"))
        return [out async for out in whole], await streamed

    outs, streamed = asyncio.run(main())
    want, other = llm.generate([PROMPTS[3], PROMPTS[0]], [params, _params(0)])
    assert len(outs) == 1 and outs[0].finished
    out = outs[0]
    assert out.new_token_ids == out.token_ids == want.token_ids
    assert out.new_exit_depths == want.exit_depths and out.new_text == want.text
    assert out.new_logprobs is not None and want.logprobs is not None
    # the two requests share GEMMs here and not there: logprobs to fp32 rounding
    assert [lp.token_id for lp in out.new_logprobs] == [lp.token_id for lp in want.logprobs]
    assert [lp.logprob for lp in out.new_logprobs] == pytest.approx(
        [lp.logprob for lp in want.logprobs], abs=1e-5
    )
    assert streamed["tokens"] == other.token_ids


def test_arrival_is_when_the_caller_sent_the_request(engine, served, monkeypatch) -> None:
    """TTFT and E2E count from the moment a request was handed to the AsyncEngine, including
    its wait in the command queue until the engine thread drains it between steps."""
    drained: list[float] = []
    add_request = served.engine.add_request

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        drained.append(time.monotonic())
        return add_request(*args, **kwargs)

    monkeypatch.setattr(served.engine, "add_request", recording)

    async def main() -> tuple[float, list]:
        busy = await engine.add(PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True), "b")
        await busy.__anext__()  # the engine thread is stepping now
        sent = time.monotonic()
        outs = [out async for out in engine.generate(PROMPTS[1], SamplingParams(max_tokens=3), "q")]
        busy.abort()
        return sent, outs

    sent, outs = asyncio.run(main())
    arrival = outs[-1].metrics.arrival_time
    assert sent <= arrival <= drained[-1]  # stamped at the send, not at the drain
    assert outs[-1].metrics.first_token_time > drained[-1]


def test_cancelled_caller_aborts(engine, served) -> None:
    async def main() -> None:
        async def consume() -> None:
            params = SamplingParams(max_tokens=500, ignore_eos=True)
            async for _ in engine.generate(PROMPTS[2], params, "c"):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    done = threading.Event()

    def idle() -> None:  # the abort reaches the engine thread on its next turn
        for _ in range(200):
            busy = served.engine.has_unfinished_requests()
            if served.engine.blocks.num_used == 0 and not busy:
                done.set()
                return
            threading.Event().wait(0.02)

    idle()
    assert done.is_set()


def test_one_requests_fault_fails_it_alone(engine, llm, monkeypatch) -> None:
    marker = "<<boom>>"
    original = IncrementalDetokenizer.push

    def push(self, token_id):  # type: ignore[no-untyped-def]
        if marker in self.stop and len(self._ids) >= 2:
            raise RuntimeError("planted")
        return original(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "push", push)

    async def main() -> tuple:
        bad = _run(engine, PROMPTS[0], SamplingParams(max_tokens=20, stop=[marker]), "bad")
        good = [
            _run(engine, p, SamplingParams(max_tokens=8), f"g{i}") for i, p in enumerate(PROMPTS)
        ]
        return await asyncio.gather(bad, *good, return_exceptions=True)

    bad, *good = asyncio.run(main())
    assert isinstance(bad, RequestFailedError) and "planted" in str(bad)
    want = llm.generate(PROMPTS, SamplingParams(max_tokens=8))
    assert [g["tokens"] for g in good] == [o.token_ids for o in want]


def test_not_ready_until_loaded(llm) -> None:
    gate = threading.Event()

    def slow_load():  # type: ignore[no-untyped-def]
        gate.wait(10)
        return llm.engine

    engine = AsyncEngine(slow_load)
    engine.start()

    async def early() -> None:
        with pytest.raises(EngineNotReadyError):
            await engine.add(PROMPTS[0], SamplingParams(max_tokens=2), "early")

    asyncio.run(early())
    assert engine.status == "loading"
    gate.set()
    assert engine.wait_ready(30)
    engine.shutdown()


def test_load_failure_is_reported() -> None:
    def broken():  # type: ignore[no-untyped-def]
        raise ValueError("config.json: field 'x' is wrong")

    engine = AsyncEngine(broken)
    engine.start()
    assert not engine.wait_ready(30)
    assert engine.status == "dead" and "field 'x'" in (engine.error or "")


# -- the engine in a process of its own (`rlt serve` runs it so) ----------------------------
def _process_engine(**kwargs) -> AsyncEngine:  # type: ignore[no-untyped-def]
    config = EngineConfig.from_options(model="demo", **OPTIONS)
    engine = AsyncEngine(functools.partial(LLMEngine, config), engine_process=True, **kwargs)
    engine.start()
    assert engine.wait_ready(120), engine.error
    return engine


def test_engine_process_equals_sync(llm) -> None:
    """In its own process the engine gives the synchronous engine's tokens, depths, text and
    logprobs, refuses a bad request with the same ValueError, frees an aborted request, and
    reports every turn; shutdown ends the process cleanly."""
    reports: list[StepReport] = []
    engine = _process_engine(on_step=reports.append, stream_interval=3)
    assert engine.info is not None and engine.info.model_type == "ouro"
    assert engine.tokenizer is not None and engine.engine is None  # the server's own copy

    async def main() -> list[dict]:
        with pytest.raises(ValueError, match="context"):
            await engine.add("x" * 100_000, SamplingParams(max_tokens=4), "too-long")
        stream = await engine.add(PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True), "a")
        assert not (await stream.__anext__()).finished
        stream.abort()
        jobs = [_run(engine, p, _params(i), f"r{i}") for i, p in enumerate(PROMPTS * 2)]
        return await asyncio.gather(*jobs)

    try:
        got = asyncio.run(main())
    finally:
        engine.shutdown()
    want = llm.generate(PROMPTS * 2, [_params(i) for i in range(8)])
    assert got == [{"tokens": o.token_ids, "depths": o.exit_depths, "text": o.text} for o in want]
    assert engine.status == "stopped" and engine.process is not None
    assert engine.process.exitcode == 0
    outputs = [o for r in reports for o in r.outputs]
    # every delta has its prompt's ids, though they crossed the pipe only once
    prompts = {f"r{i}": o.prompt_token_ids for i, o in enumerate(want)}
    assert all(
        o.prompt_token_ids == prompts[o.request_id] for o in outputs if o.request_id[0] == "r"
    )
    assert sum(o.request_id == "r0" for o in outputs) > 2
    finished = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert finished["a"] == "abort" and len(finished) == 9
    last = reports[-1].stats
    assert last.blocks_used == 0 and last.num_running == last.num_waiting == 0
    assert any(r.wall_s is None for r in reports)  # the abort's own turn: no step ran


def test_engine_process_death_fails_open_streams() -> None:
    """The engine process killed mid-stream: the open stream ends with EngineDeadError, the
    engine is dead (with the exit code), and new requests are refused; nothing hangs."""
    engine = _process_engine()
    assert engine.process is not None and engine.process.pid is not None

    async def main() -> None:
        params = SamplingParams(max_tokens=2000, ignore_eos=True)
        stream = await engine.add(PROMPTS[0], params, "long")
        await stream.__anext__()
        os.kill(engine.process.pid, signal.SIGKILL)  # type: ignore[union-attr]
        with pytest.raises(EngineDeadError, match="exit code -9"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add(PROMPTS[1], SamplingParams(max_tokens=2), "after")

    asyncio.run(asyncio.wait_for(main(), 60))
    assert engine.status == "dead" and "exited unexpectedly" in (engine.error or "")
    engine.shutdown()


def test_engine_process_load_failure_is_reported(tmp_path) -> None:
    config = EngineConfig.from_options(model=str(tmp_path / "missing"), device="cpu")
    engine = AsyncEngine(functools.partial(LLMEngine, config), engine_process=True)
    engine.start()
    assert not engine.wait_ready(120)
    assert engine.status == "dead" and "model failed to load" in (engine.error or "")
    engine.shutdown()
    assert engine.process is not None and engine.process.exitcode == 0


def test_engine_process_exits_with_its_parent(tmp_path) -> None:
    """A server killed outright (no shutdown) leaves no engine process behind: the engine
    process sees its command pipe close and stops."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import functools, os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "from rlt_engine.async_engine import AsyncEngine\n"
        "from rlt_engine.config import EngineConfig\n"
        "from rlt_engine.engine import LLMEngine\n"
        "if __name__ == '__main__':\n"
        "    config = EngineConfig.from_options(model='demo', device='cpu', dtype='float32')\n"
        "    engine = AsyncEngine(functools.partial(LLMEngine, config), engine_process=True)\n"
        "    engine.start()\n"
        "    assert engine.wait_ready(120), engine.error\n"
        "    print(engine.process.pid, flush=True)\n"
        "    os._exit(0)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env
    )
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while running(pid):
        assert time.monotonic() < deadline, f"engine process {pid} outlived its parent"
        time.sleep(0.1)


def test_a_fault_reading_the_engine_process_stops_it() -> None:
    """A bug on the server's side of the pipe (here in the metrics callback) must not leave
    streams waiting on a reader that is gone: they end with EngineDeadError, the engine is
    dead with the cause, and the engine process exits."""

    def broken_metrics(report: StepReport) -> None:
        if report.outputs:
            raise KeyError("planted")

    engine = _process_engine(on_step=broken_metrics)

    async def main() -> None:
        stream = await engine.add(PROMPTS[0], SamplingParams(max_tokens=50), "m")
        with pytest.raises(EngineDeadError, match="planted"):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(main(), 60))
    assert engine.status == "dead" and "stopped reading the engine" in (engine.error or "")
    assert engine.process is not None
    engine.process.join(30)
    assert engine.process.exitcode is not None
    engine.shutdown()


def test_add_all_takes_every_request_on_one_turn(llm) -> None:
    """`n` choices or a list of prompts reach the engine together: with the engine busy, their
    first tokens come from one step (added one by one, one a turn, they would not), with the
    synchronous engine's tokens."""
    reports: list[StepReport] = []
    engine = _process_engine(on_step=reports.append)
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    async def main() -> list[list[int]]:
        busy = await engine.add(PROMPTS[0], SamplingParams(max_tokens=300, ignore_eos=True), "b")
        await busy.__anext__()
        # three: with the busy one they fill the 4 slots, so none waits for a slot
        streams = await engine.add_all([(p, params, f"x{i}") for i, p in enumerate(PROMPTS[1:])])
        finals = []
        for stream in streams:
            finals.append([out async for out in stream][-1])
        busy.abort()
        return [f.token_ids for f in finals]

    try:
        got = asyncio.run(main())
    finally:
        engine.shutdown()
    assert got == [o.token_ids for o in llm.generate(PROMPTS[1:], params)]
    first = {}
    for step, report in enumerate(reports):
        for out in report.outputs:
            if out.request_id.startswith("x") and out.new_token_ids:
                first.setdefault(out.request_id, step)
    assert len(first) == 3 and len(set(first.values())) == 1, first


def test_caller_cancelled_before_the_answer_leaves_nothing(engine, served) -> None:
    """A caller cancelled while its add waits for the engine's answer: the request is aborted
    whether the answer came first or not, and nothing of it stays (no route, no pending add,
    every block back)."""

    async def main() -> None:
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        task = asyncio.ensure_future(engine.add_all([(PROMPTS[0], params, "early")]))
        await asyncio.sleep(0)  # the add is sent; its answer cannot have been read yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):  # the answer and the abort's output arrive; nobody reads them
            if not engine._state.streams and not engine._pending:
                break
            await asyncio.sleep(0.02)

    asyncio.run(main())
    for _ in range(200):
        if served.engine.blocks.num_used == 0 and not served.engine.has_unfinished_requests():
            break
        time.sleep(0.02)
    assert not served.engine.has_unfinished_requests()
    assert not engine._state.streams and not engine._pending


def test_add_all_refused_leaves_nothing(engine, served) -> None:
    """One request of several refused: ValueError, and the others never run (the fixture
    checks that every block is back)."""

    async def main() -> None:
        good = (PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True), "ok")
        bad = ("x" * 100_000, SamplingParams(max_tokens=4), "too-long")
        with pytest.raises(ValueError, match="context"):
            await engine.add_all([good, bad, (PROMPTS[1], good[1], "ok2")])
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_all([good, good])

    asyncio.run(main())
    for _ in range(200):  # the aborts reach the engine on its next turn
        if served.engine.blocks.num_used == 0 and not served.engine.has_unfinished_requests():
            break
        time.sleep(0.02)
    assert not served.engine.has_unfinished_requests()
