"""The API server's CPU per streamed token, HTTP aside, against a scripted engine process.

`rlt serve`'s API server turns each engine step into SSE chunks: its events thread unpickles
the step's outputs, routes them and records the metrics; its event loop wakes each request's
stream, renders the chunk and encodes it. `serving_host_cpu.py` measures all of that through
a real model and real HTTP, where the model and the client share the host's cores with the
server and move its numbers by +-15 us a token. This measures the same code alone: a
scripted core in a process of its own answers the server's pipe as the engine process
would (accepts its adds, then emits a step with `--tokens-per-step` new
tokens for every running request, each finishing at `--output-len`; the step time makes
the engine offer `--token-rate` tokens a second, a rate the server keeps up with, so that it
renders one chunk a step as it would for a GPU), and `-c` streams, each replaced by a new
request when it ends, are rendered to SSE text by the server's own `Serving._events` on a
real event loop. The server's threads' CPU time (from /proc) over the tokens delivered is
the result, with the garbage collector's pauses in that time:

    python benchmarks/serving_path_cpu.py -c 64,256 --json

What is left out: HTTP parsing and routing per request, and uvicorn's socket write per chunk.
`--http` puts them back: the same core behind `rlt serve`'s own app and uvicorn on this
process's main thread, driven over a socket by `rlt bench --url` (a client process sharing the
cores). Offered more than it can write, the server falls behind and merges each stream's
queued deltas into fewer chunks: the delivered rate at a high `--token-rate` is one API
server's ceiling on this host:

    python benchmarks/serving_path_cpu.py --http -c 64,256 --token-rate 32000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from serving_host_cpu import bench, free_port, thread_cpu  # a script of this directory

from rlt_engine.async_engine import AsyncEngine
from rlt_engine.engine_core import (
    AbortRequest,
    AddRequest,
    CoreReady,
    CoreTurn,
    Inbox,
    StopCore,
)
from rlt_engine.engine_info import EngineInfo
from rlt_engine.engine_process import PromptIds
from rlt_engine.heap import freeze_startup_heap
from rlt_engine.outputs import EngineStats, RequestMetrics, RequestOutput
from rlt_engine.server.config import ServerConfig
from rlt_engine.server.metrics import ServerMetrics
from rlt_engine.server.serving import Serving, _CompletionRender

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "rlt_engine" / "assets" / "ouro-gsm8k-tiny"


def _info(max_num_seqs: int) -> EngineInfo:
    return EngineInfo(
        model="bench", model_dir=str(DEMO), model_type="ouro", num_loops=4,
        max_model_len=4096, vocab_size=4096, has_tokenizer=True, device="cpu",
        device_name="cpu", dtype="float32", kv_layout="last_exited", num_planes=4,
        num_blocks=8192, block_size=16, kv_cache={}, max_num_seqs=max_num_seqs,
        attention_backend="torch", attention_impl="torch", cuda_graphs=False, decode_window=8,
        kernels={}, default_min_loops=1, default_max_loops=4, default_exit_threshold=1.0,
        notice=None,
    )  # fmt: skip


class _Running:
    def __init__(self, prompt: list[int], arrival: float) -> None:
        self.prompt, self.arrival, self.made, self.first = prompt, arrival, 0, 0.0


def scripted_core(commands: Any, events: Any, args: dict[str, Any]) -> None:
    """The engine process's side of the pipe, with no model: every `step_ms`, `tokens_per_step`
    tokens (ids 100.., text ' ab' each) for every running request. Commands arrive through
    the core's `Inbox` and prompt ids cross once (`PromptIds`), as in the engine process."""
    inbox, prompts = Inbox(), PromptIds()

    def read() -> None:
        while True:
            try:
                inbox.put(commands.recv())
            except EOFError:
                return

    threading.Thread(target=read, daemon=True).start()
    events.send(CoreReady(_info(args["max_num_seqs"])))
    running: dict[str, _Running] = {}
    step_s, per_step, total = args["step_ms"] / 1e3, args["tokens_per_step"], args["output_len"]
    next_step = time.monotonic()
    while True:
        turn = CoreTurn()
        for command in inbox.drain():
            if isinstance(command, StopCore):
                return
            if isinstance(command, AddRequest):
                running[command.request_id] = _Running(command.prompt, command.arrival)
                turn.accepted.append(command.request_id)
            elif isinstance(command, AbortRequest):
                running.pop(command.request_id, None)
        now = time.monotonic()
        if now < next_step:
            if turn.accepted:
                events.send(turn)
            time.sleep(min(next_step - now, 0.001))
            continue
        next_step += step_s
        for rid, r in list(running.items()):
            n = min(per_step, total - r.made)
            r.first = r.first or now
            r.made += n
            done = r.made >= total
            out = RequestOutput(
                request_id=rid,
                prompt_token_ids=r.prompt,
                new_token_ids=list(range(100, 100 + n)),
                new_exit_depths=[4] * n,
                new_text=" ab" * n,
                new_logprobs=None,
                num_tokens=r.made,
                finished=done,
                finish_reason="length" if done else None,
                metrics=RequestMetrics(r.arrival, r.first, now if done else None),
                token_ids=list(range(r.made)) if done else [],
                exit_depths=[4] * r.made if done else [],
                text=" ab" * r.made if done else "",
            )
            if done:
                del running[rid]
            turn.outputs.append(out)
        turn.stats = EngineStats(len(running), 0, 0, 100, 8192, 0, 0, 0, len(running))
        turn.wall_s = step_s
        prompts.strip(turn)
        events.send(turn)


class GCPauses:
    """The cyclic collector's runs while inside: count, total and longest pause by generation."""

    def __init__(self) -> None:
        self.runs: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._start = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.runs[info["generation"]].append(time.perf_counter() - self._start)

    def __enter__(self) -> None:
        gc.callbacks.append(self._callback)

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            f"gen{g}": {"runs": len(r), "ms": 1e3 * sum(r), "max_ms": 1e3 * max(r, default=0.0)}
            for g, r in self.runs.items()
        }


async def _serve(serving: Serving, concurrency: int, requests: int, prompt: list[int]) -> dict:
    from rlt_engine.sampling_params import SamplingParams

    counts = {"chunks": 0, "bytes": 0, "requests": 0}
    started = 0

    async def client() -> None:
        nonlocal started
        while started < requests:
            started += 1
            params = SamplingParams(max_tokens=10**6, ignore_eos=True)
            job = await serving._start("bench", "cmpl", [(prompt, params)], True)
            try:  # (released, so aborted, whatever happens: a request left running hangs exit)
                render = _CompletionRender(serving.tokenizer, None, 1)
                async for chunk in serving._events(job, False, render):
                    counts["chunks"] += 1
                    counts["bytes"] += len(chunk)
            finally:
                serving._release(job)
            counts["requests"] += 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return counts


def _uvloop_run(main: Any) -> Any:
    import uvloop

    return uvloop.run(main)


def _run_http(
    engine: AsyncEngine, metrics: ServerMetrics, concurrency: int, args: argparse.Namespace
) -> dict[str, Any]:
    """The same core behind `rlt serve`'s real app and uvicorn on this process's main thread
    (its own load watcher freezes the heap), driven over a socket by `rlt bench --url`."""
    from rlt_engine.server.launch import http_server

    port = free_port()
    config = ServerConfig(port=port, max_concurrent_requests=max(256, concurrency))
    server = http_server(engine, config, ["bench"], metrics)
    url, row = f"http://127.0.0.1:{port}", {}

    def drive() -> None:
        try:
            while not (engine.status == "ready" and server.started):
                time.sleep(0.05)
            bench(url, concurrency, concurrency, args)  # warm-up
            pauses = GCPauses()
            main0, other0 = thread_cpu(os.getpid())
            with pauses:
                report = bench(url, concurrency, args.num_prompts, args)
            main1, other1 = thread_cpu(os.getpid())
            tokens = report["total_output_tokens"]
            row.update(
                concurrency=concurrency,
                requests=report["completed"],
                tokens=tokens,
                chunks_per_token=1 / report["tokens_per_chunk"],
                wall_s=report["duration_s"],
                tokens_per_s=report["output_throughput"],
                ttft_ms_p50=report["ttft_ms"]["median"],
                tpot_ms_p50=report["tpot_ms"]["median"],
                failed=report["failed"],
                event_loop_us_per_token=(main1 - main0) / tokens * 1e6,
                other_threads_us_per_token=(other1 - other0) / tokens * 1e6,
                gc=pauses.summary(),
            )
        finally:
            server.should_exit = True

    threading.Thread(target=drive, name="bench-driver", daemon=True).start()
    server.run()
    if not row:
        raise SystemExit("the HTTP run failed (see above)")
    return row


def run(concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    commands_out, commands_in = ctx.Pipe(duplex=False)
    events_out, events_in = ctx.Pipe(duplex=False)
    core_args = {
        "max_num_seqs": concurrency,
        "step_ms": 1e3 * concurrency * args.tokens_per_step / args.token_rate,
        "tokens_per_step": args.tokens_per_step,
        "output_len": args.output_len,
    }
    core = ctx.Process(target=scripted_core, args=(commands_out, events_in, core_args))
    core.start()
    commands_out.close()
    events_in.close()
    metrics = ServerMetrics("bench", concurrency)
    engine = AsyncEngine.attach(commands_in, events_out, on_step=metrics.record)
    if args.http:
        try:
            return _run_http(engine, metrics, concurrency, args)
        finally:
            core.join(10)
    engine.start()
    assert engine.wait_ready(60), engine.error
    config = ServerConfig(max_concurrent_requests=concurrency)
    serving = Serving(engine, ["bench"], config)
    prompt = list(range(200, 200 + args.prompt_len))
    event_loop = asyncio.run if args.asyncio else _uvloop_run  # the server's: uvloop
    event_loop(_serve(serving, concurrency, concurrency, prompt))  # warm-up
    if args.python_gc == "rlt":  # as `rlt serve`'s API server does once its engine is ready
        freeze_startup_heap()
    pauses = GCPauses()
    main0, other0, wall0 = *thread_cpu(os.getpid()), time.perf_counter()
    with pauses:
        counts = event_loop(_serve(serving, concurrency, args.num_prompts, prompt))
    main1, other1, wall1 = *thread_cpu(os.getpid()), time.perf_counter()
    engine.shutdown()
    core.join(10)
    tokens = counts["requests"] * args.output_len
    return {
        "concurrency": concurrency,
        "requests": counts["requests"],
        "tokens": tokens,
        "chunks_per_token": counts["chunks"] / tokens,
        "wall_s": wall1 - wall0,
        "tokens_per_s": tokens / (wall1 - wall0),
        "event_loop_us_per_token": (main1 - main0) / tokens * 1e6,
        "other_threads_us_per_token": (other1 - other0) / tokens * 1e6,
        "gc": pauses.summary(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--concurrency", default="64,256")
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--tokens-per-step", type=int, default=2, help="2: a window of 8 at depth 4")
    p.add_argument("--token-rate", type=float, default=8000.0, help="tokens/s the core offers")
    p.add_argument("--repeat", type=int, default=3, help="runs per concurrency (median kept)")
    p.add_argument(
        "--python-gc",
        choices=("rlt", "default"),
        default="rlt",
        help="rlt: the startup heap frozen as `rlt serve` does (rlt_engine/heap.py); "
        "default: CPython's collector as it comes",
    )
    p.add_argument("--asyncio", action="store_true", help="asyncio's event loop, not uvloop")
    p.add_argument(
        "--http",
        action="store_true",
        help="serve the core through rlt serve's app and uvicorn, driven by `rlt bench --url` "
        "(a client process on the same cores; the collector as rlt serve sets it)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.http and (args.python_gc != "rlt" or args.asyncio):
        p.error("--http runs rlt serve's own app: uvloop, the collector as it sets it")
    args.input_len = args.prompt_len  # serving_host_cpu.bench's name for it
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        runs = [run(c, args) for _ in range(args.repeat)]
        row = dict(runs[0])
        for key in ("event_loop_us_per_token", "other_threads_us_per_token", "tokens_per_s"):
            row[key] = statistics.median(r[key] for r in runs)
            row[key + "_runs"] = [round(r[key], 1) for r in runs]
        row["gc"] = [r["gc"] for r in runs]
        rows.append(row)
        if not args.json:
            print(
                f"c={c}: event loop {row['event_loop_us_per_token']:.1f} us/token "
                f"{row['event_loop_us_per_token_runs']}, other threads "
                f"{row['other_threads_us_per_token']:.1f} us/token "
                f"{row['other_threads_us_per_token_runs']}, "
                f"{row['chunks_per_token']:.2f} chunks/token, {row['tokens_per_s']:.0f} tok/s"
            )
            for pauses in row["gc"]:
                gcs = ", ".join(
                    f"{g} {v['runs']} x, {v['ms']:.0f} ms (max {v['max_ms']:.0f})"
                    for g, v in pauses.items()
                )
                print(f"    collector: {gcs}")
    if args.json:
        print(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
