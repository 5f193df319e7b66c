"""Run a decode workload (the `rlt bench` one) under torch.profiler, engine phases marked.

The engine is not edited for this: `instrument(engine)` wraps its methods from outside with
`torch.profiler.record_function` ranges for the time it is active, and puts them back after:

    rlt.step           LLMEngine.step
    rlt.add_request    LLMEngine.add_request
    rlt.schedule       Scheduler.schedule
    rlt.update         Scheduler.update (the detokenizer's stop-string checks nest inside)
    rlt.execute        ModelRunner.launch (its own time: the bookkeeping diffs, copies in)
    rlt.prefill        ModelRunner._prefill, one range per wave; ModelRunner._rider, the host
                       side of a wave that rides a decode window (its GPU work is the window's)
    rlt.decode_window  ModelRunner._decode: the window's traversals (or graph replays)
    rlt.read_back      ModelRunner.collect: waiting for the one device-to-host read, decoding it
                       (async scheduling: while the next window already runs)
    rlt.sample         the batched sampler (prefill's first tokens; eager decode traversals;
                       inside a CUDA graph it is part of the decode window)
    rlt.detokenize     IncrementalDetokenizer.push / take_new

A method the engine no longer has is skipped and named in the summary's `missing_markers`.
Warm-up runs (not profiled) come first, so graph capture and Triton compilation stay out.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function

from rlt_engine.bench.floor import weight_bytes
from rlt_engine.bench.throughput import run_once
from rlt_engine.engine import LLMEngine
from rlt_engine.profile.trace import ROOT, analyze, load_trace
from rlt_engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    concurrency: int = 8
    prompt_len: int = 64
    output_len: int = 32  # ignore_eos: every request makes exactly this many tokens
    warmup: int = 1  # unprofiled runs first (graph capture, Triton compilation)
    params: SamplingParams | None = None  # loop controls; greedy unless set
    seed: int = 0


@dataclass
class Counters:
    decode_traversals: int = 0
    missing: list[str] = field(default_factory=list)


def _marked(label: str, fn: Callable[..., Any], after: Callable[..., None] | None = None):
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            out = fn(*args, **kwargs)
        if after is not None:
            after(out, *args, **kwargs)
        return out

    return wrapper


@contextlib.contextmanager
def instrument(engine: LLMEngine) -> Iterator[Counters]:
    """Mark the engine's phases with record_function ranges while the context is active."""
    import rlt_engine.detokenizer as detokenizer_module

    counters = Counters()
    restore: list[tuple[Any, str, Any, bool]] = []  # (owner, name, original, was own attr)

    def wrap(owner: Any, name: str, label: str, after: Callable[..., None] | None = None):
        where = getattr(owner, "__name__", type(owner).__name__)
        original = getattr(owner, name, None)
        if original is None or not callable(original):
            counters.missing.append(f"{where}.{name}")
            return
        own = name in vars(owner)
        restore.append((owner, name, vars(owner).get(name), own))
        setattr(owner, name, _marked(label, original, after))

    def count_traversals(out: Any, traversals: int, *_: Any) -> None:
        if out is not None:
            counters.decode_traversals += int(traversals)

    runner, scheduler = engine.runner, engine.scheduler
    wrap(engine, "step", "rlt.step")
    wrap(engine, "add_request", "rlt.add_request")
    wrap(scheduler, "schedule", "rlt.schedule")
    wrap(scheduler, "update", "rlt.update")
    wrap(runner, "launch", "rlt.execute")
    wrap(runner, "_prefill", "rlt.prefill")
    wrap(runner, "_rider", "rlt.prefill")
    wrap(runner, "_decode", "rlt.decode_window", count_traversals)
    wrap(runner, "collect", "rlt.read_back")
    wrap(runner, "_sample", "rlt.sample")
    try:
        import rlt_engine.worker.decode as decode_module

        wrap(decode_module, "sample", "rlt.sample")
    except ImportError:
        counters.missing.append("rlt_engine.worker.decode.sample")
    detok = detokenizer_module.IncrementalDetokenizer
    wrap(detok, "push", "rlt.detokenize")
    wrap(detok, "take_new", "rlt.detokenize")
    try:
        yield counters
    finally:
        for owner, name, original, own in reversed(restore):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # an instance attribute over the class's method


def profile_workload(
    engine: LLMEngine,
    workload: Workload,
    trace_out: str | Path,
    *,
    top: int = 15,
    on_phase: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Warm up, profile one run of `workload`, write the Chrome trace to `trace_out` (".gz":
    compressed) and return the summary (rlt_engine.profile.trace.analyze) with the run's
    numbers: decode tokens/s under the profiler, steps, traversals."""
    w = workload
    if w.output_len < 2:
        raise ValueError(
            f"output_len must be >= 2 (decode starts after a first token), got {w.output_len}"
        )
    params = replace(w.params or SamplingParams(), max_tokens=w.output_len, ignore_eos=True)

    def run(seed: int):
        return run_once(engine, w.concurrency, w.prompt_len, w.output_len, params, seed=seed)

    for i in range(w.warmup):
        if on_phase is not None:
            on_phase(f"warm-up {i + 1}/{w.warmup}")
        run(w.seed + 1000 + i)
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if on_phase is not None:
        on_phase("profiling")
    before = engine.stats()
    with instrument(engine) as counters, profile(activities=activities) as prof:
        t = time.perf_counter()
        with record_function(ROOT):
            result = run(w.seed)  # synchronizes the device at the end
        wall_s = time.perf_counter() - t
    after = engine.stats()  # graphs captured in the profiled run: their host time is in it
    if on_phase is not None:
        on_phase("writing the trace")
    trace_out = Path(trace_out)
    trace_out.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_out))
    if on_phase is not None:
        on_phase("summarising")
    token_steps = w.output_len - 1
    layers = engine.model.config.num_layers
    summary = analyze(
        load_trace(trace_out),
        token_steps=token_steps,
        traversals=counters.decode_traversals,
        layers=layers,
        top=top,
        cuda=cuda,
    )
    return {
        "trace": str(trace_out),
        "profiled_wall_s": wall_s,
        "decode_tokens_per_s": result.decode_tokens_per_s,  # under the profiler (overhead in)
        "token_steps": token_steps,
        "decode_traversals": counters.decode_traversals,
        # a traversal's weight bytes (bench/floor.py) spread over its layers: what a layer run
        # streams, against the chain's cadence
        "layer_weight_bytes": weight_bytes(engine.model).layer_stack / layers,
        "engine_steps": result.steps,
        "missing_markers": counters.missing,
        "graphs_captured": after.graphs_captured - before.graphs_captured,
        "graph_capture_s": after.graph_capture_s - before.graph_capture_s,
        **summary,
    }
