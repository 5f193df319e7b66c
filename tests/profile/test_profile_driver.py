"""The profile driver on a tiny checkpoint: markers while active, the engine untouched after."""

from __future__ import annotations

from pathlib import Path

from torch.profiler import ProfilerActivity, profile

import rlt_engine.worker.decode as decode_module
from rlt_engine.bench.floor import weight_bytes
from rlt_engine.detokenizer import IncrementalDetokenizer
from rlt_engine.llm import LLM
from rlt_engine.profile.driver import Workload, instrument, profile_workload
from rlt_engine.profile.trace import load_trace
from rlt_engine.sampling_params import SamplingParams

CPU = {"device": "cpu", "dtype": "float32", "num_blocks": 64}
MARKERS = {
    "rlt.step", "rlt.add_request", "rlt.schedule", "rlt.update", "rlt.execute", "rlt.prefill",
    "rlt.decode_window", "rlt.read_back", "rlt.sample",
}  # fmt: skip


def test_instrument_marks_every_phase_and_puts_the_methods_back(ckpt: Path, tmp_path: Path) -> None:
    engine = LLM(str(ckpt), **CPU).engine
    owners = (engine, engine.runner, engine.scheduler)
    before = [set(vars(o)) for o in owners]
    functions = (decode_module.sample, IncrementalDetokenizer.push, IncrementalDetokenizer.take_new)
    with instrument(engine) as counters, profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    assert counters.missing == [] and counters.decode_traversals > 0
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    names = {e.get("name") for e in load_trace(tmp_path / "t.json")["traceEvents"]}
    assert names >= MARKERS, MARKERS - names
    # the wrappers were instance attributes over the methods, or module/class attributes
    assert [set(vars(o)) for o in owners] == before
    assert "step" not in vars(engine) and "execute" not in vars(engine.runner)
    after = (decode_module.sample, IncrementalDetokenizer.push, IncrementalDetokenizer.take_new)
    assert after == functions


def test_profile_workload_without_a_tokenizer(ckpt: Path, tmp_path: Path) -> None:
    engine = LLM(str(ckpt), **CPU).engine
    out = tmp_path / "deep" / "trace.json.gz"
    s = profile_workload(engine, Workload(concurrency=2, prompt_len=5, output_len=3, warmup=0), out)
    assert s["trace"] == str(out) and load_trace(out)["traceEvents"]
    phases = {p["phase"]: p for p in s["phases"]}
    assert phases["detokenize"]["calls"] == 0  # no tokenizer: no detokenizer
    assert phases["decode_window"]["ms"] > 0 and phases["prefill"]["ms"] > 0
    assert s["token_steps"] == 2 and s["decode_traversals"] >= 2 * 4
    layers = engine.model.config.num_layers
    assert s["layer_weight_bytes"] == weight_bytes(engine.model).layer_stack / layers > 0
    assert not engine.has_unfinished_requests()
