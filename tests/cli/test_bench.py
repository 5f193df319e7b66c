"""`rlt bench` on tiny checkpoints, in-process through typer's CliRunner: --json, table, errors;
the weight-bandwidth floor (rlt_engine/bench/floor.py) on hand-computed cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_checkpoints
import torch
from typer.testing import CliRunner, Result

import rlt_cli.bench as bench_cli
from rlt_cli.main import app
from rlt_cli.output import stdout
from rlt_engine.bench.floor import (
    _distinct_bytes,
    floor_tokens_per_s,
    measure_copy_bandwidth,
    weight_bytes,
)
from rlt_engine.checkpoints.loader import load_model
from rlt_engine.checkpoints.resolve import DEMO_DIR, KNOWN_CONFIGS
from rlt_engine.core.exit_rule import LoopControls
from rlt_engine.models.configs import load_config
from rlt_engine.models.registry import model_class

CPU = ("--dtype", "float32", "--device", "cpu", "--num-blocks", "256")
TINY = ("--prompt-len", "4", "--output-len", "4", "--repeats", "1", "--warmup", "0")
DEPTH = 4  # total_ut_steps of the tiny Ouro
METRICS = ("decode_tokens_per_s", "ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "e2e_ms_p50")


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, ["bench", *args])


def run_tiny(model_dir: Path, *args: str) -> Result:
    return invoke("--model", str(model_dir), *CPU, *TINY, *args)


def run_json(model_dir: Path, *args: str) -> dict:
    result = run_tiny(model_dir, "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # stdout holds the JSON object and nothing else


def assert_one_error_line(result: Result, *needles: str) -> None:
    assert result.exit_code not in (0, None), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_json_reports_every_concurrency(tiny_ouro_dir: Path) -> None:
    data = run_json(tiny_ouro_dir, "--concurrency", "1", "--concurrency", "2")
    assert data["num_loops"] == DEPTH and data["model"] == str(tiny_ouro_dir)
    assert (data["prompt_len"], data["output_len"], data["exit_threshold"]) == (4, 4, 1.0)
    assert [r["concurrency"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        for key in METRICS:
            assert isinstance(r[key], float) and r[key] > 0, key
        assert r["ttft_ms_p90"] >= r["ttft_ms_p50"]
        assert len(r["decode_tokens_per_s_all"]) == 1
        # fixed depth by default: every output token of every request ran all loops
        assert r["exit_depths"] == {"1": 0, "2": 0, "3": 0, "4": 4 * r["concurrency"]}


def test_loop_controls_reach_the_requests(tiny_ouro_dir: Path) -> None:
    capped = run_json(tiny_ouro_dir, "-c", "1", "--max-loops", "2")["results"][0]
    # the first token comes from full-depth prefill; decode tokens stop at --max-loops
    assert capped["exit_depths"] == {"1": 0, "2": 3, "3": 0, "4": 1}
    adaptive = run_json(tiny_ouro_dir, "-c", "2", "--exit-threshold", "0.5")["results"][0]
    assert sum(adaptive["exit_depths"].values()) == 8


def test_penalties_reach_the_requests(tiny_ouro_dir: Path, monkeypatch) -> None:
    """--presence/frequency/repetition-penalty: every request runs the sampler's logit-edit
    variant (its cost is what they measure), and the report says so."""
    from rlt_engine.engine import LLMEngine

    seen = []
    add = LLMEngine.add_request

    def spy(self, prompt, params=None, **kw):  # type: ignore[no-untyped-def]
        seen.append(params)
        return add(self, prompt, params, **kw)

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    data = run_json(
        tiny_ouro_dir, "-c", "2", "--repetition-penalty", "1.3", "--frequency-penalty", "-1"
    )
    assert (data["repetition_penalty"], data["frequency_penalty"], data["presence_penalty"]) == (
        1.3,
        -1.0,
        0.0,
    )
    assert seen and all(p.repetition_penalty == 1.3 and p.frequency_penalty == -1 for p in seen)
    assert_one_error_line(
        run_tiny(tiny_ouro_dir, "--presence-penalty", "3"), "--presence-penalty", "[-2, 2]"
    )


def test_works_without_a_tokenizer(tmp_path: Path) -> None:
    model_dir = tiny_checkpoints.write_tiny_ouro(tmp_path, tokenizer_from=None)
    data = run_json(model_dir, "-c", "1")
    assert data["results"][0]["decode_tokens_per_s"] > 0


@pytest.fixture
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Render tables 200 columns wide (CliRunner's default is 80, which wraps headers)."""
    monkeypatch.setattr(stdout, "_width", 200)


@pytest.mark.usefixtures("wide_terminal")
def test_human_table(tiny_ouro_dir: Path) -> None:
    result = run_tiny(tiny_ouro_dir, "-c", "1", "-c", "2")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "tok/s" in out and "TTFT p50" in out and "TPOT p50" in out and "E2E p50" in out
    assert "% floor" in out and "peak" in out and "floor: n/a" in out
    assert "attention torch (auto), eager, decode window 8" in out
    header = next(line for line in out.splitlines() if "concurrency" in line)
    assert header.split()[-DEPTH:] == [f"d{d}" for d in range(1, DEPTH + 1)]
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [row[0] for row in rows] == ["1", "2"]
    assert [row[-DEPTH:] for row in rows] == [["0", "0", "0", "4"], ["0", "0", "0", "8"]]
    assert "fixed depth 4" in out


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("--output-len", "1"), ("--output-len must be >= 2",)),
        (("--prompt-len", "0"), ("--prompt-len must be >= 1",)),
        (("--repeats", "0"), ("--repeats must be >= 1",)),
        (("--warmup", "-1"), ("--warmup must be >= 0",)),
        (("--concurrency", "0"), ("--concurrency must be >= 1",)),
        (("--concurrency", "9", "--max-num-seqs", "8"), ("exceeds --max-num-seqs 8",)),
        (("--exit-threshold", "1.5"), ("--exit-threshold",)),
        (("--min-loops", "3", "--max-loops", "2"), ("--min-loops (3) must be <= --max-loops (2)",)),
        (("--concurrency", "two"), ("--concurrency", "rlt bench --help")),
        (("--no-such-flag",), ("--no-such-flag",)),
        (("--dtype", "float8"), ("float8",)),
    ],
)
def test_bad_values_fail_with_one_line(tiny_ouro_dir: Path, args: tuple, needles: tuple) -> None:
    assert_one_error_line(run_tiny(tiny_ouro_dir, *args), *needles)


def test_errors_after_loading_are_one_line_too(tiny_ouro_dir: Path) -> None:
    assert_one_error_line(run_tiny(tiny_ouro_dir, "--max-loops", "9"), "model depth (4)")
    assert_one_error_line(run_tiny(tiny_ouro_dir, "--prompt-len", "100000"), "context")
    assert_one_error_line(invoke("--model", "/no/such/model", *CPU, *TINY))


# -- item 10: execution flags, sweeps, long prompts, peak memory, the floor --------------
def test_json_reports_execution_floor_and_memory(tiny_ouro_dir: Path) -> None:
    data = run_json(
        tiny_ouro_dir,
        "-c",
        "1,2",
        "--attention-backend",
        "torch",
        "--enforce-eager",
        "--decode-window",
        "2",
        "--bandwidth-gbs",
        "100",
    )
    assert data["attention_backend"] == "torch" and data["attention_impl"] == "torch"
    assert data["enforce_eager"] is True and data["cuda_graphs"] is False
    assert data["decode_window"] == 2 and data["max_num_seqs"] == 64
    assert (data["bandwidth_gbs"], data["bandwidth_source"]) == (100.0, "given")
    weights = data["weight_bytes"]
    assert min(weights["layer_stack"], weights["coda"], weights["embedding_row"]) > 0
    full = weights["per_token_step_at_full_depth"]
    assert full == DEPTH * weights["layer_stack"] + weights["coda"]
    assert [r["concurrency"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        assert r["peak_memory_bytes"] is None and r["memory_start_bytes"] is None  # CPU
        assert r["floor_loops"] == DEPTH and r["bytes_per_token_step"] == full
        assert r["floor_tokens_per_s"] == pytest.approx(r["concurrency"] * 100e9 / full)
        assert r["floor_share"] == pytest.approx(r["decode_tokens_per_s"] / r["floor_tokens_per_s"])


def test_floor_is_na_on_cpu_without_a_bandwidth(tiny_ouro_dir: Path) -> None:
    data = run_json(tiny_ouro_dir, "-c", "1")
    assert data["bandwidth_gbs"] is None and data["bandwidth_source"] is None
    r = data["results"][0]
    assert r["floor_tokens_per_s"] is None and r["floor_share"] is None
    assert r["peak_memory_bytes"] is None
    assert (r["graphs_captured"], r["graph_capture_s"]) == (0, 0.0)  # no CUDA graphs on CPU
    assert (data["graphs_at_start"], data["graph_capture_s_at_start"]) == (0, 0.0)


def test_decode_window_reaches_the_engine(tiny_ouro_dir: Path) -> None:
    # 3 decode tokens x 4 loops = 12 traversals: one per step at window 1, a few at window 8
    one = run_json(tiny_ouro_dir, "-c", "1", "--decode-window", "1")
    eight = run_json(tiny_ouro_dir, "-c", "1", "--decode-window", "8")
    assert one["decode_window"] == 1 and eight["decode_window"] == 8
    assert one["results"][0]["steps_per_run"] >= 12 > eight["results"][0]["steps_per_run"]


def test_thousand_token_prompts(tiny_ouro_dir: Path) -> None:
    # later flags win: 1,024-token prompts (random ids of exactly that length), 2 outputs
    args = ("--prompt-len", "1024", "--output-len", "2", "--num-blocks", "1024")
    data = run_json(tiny_ouro_dir, "-c", "2", *args)
    assert data["prompt_len"] == 1024 and data["num_blocks"] == 1024
    assert data["results"][0]["exit_depths"]["4"] == 4  # 2 requests x 2 tokens


def _parsed(monkeypatch: pytest.MonkeyPatch, *args: str) -> bench_cli.BenchRun:
    seen: list[bench_cli.BenchRun] = []
    monkeypatch.setattr(bench_cli, "_bench", seen.append)
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return seen[0]


def test_concurrency_sweeps_to_256_size_the_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    run = _parsed(monkeypatch, "-c", "1", "-c", "8,64", "--concurrency", "256,8")
    assert run.concurrency == (1, 8, 64, 256)
    assert run.engine_options["max_num_seqs"] == 256  # enough slots for every request
    assert _parsed(monkeypatch, "-c", "8").engine_options["max_num_seqs"] == 64  # the default
    run = _parsed(monkeypatch, "-c", "8", "--max-num-seqs", "16", "--prompt-len", "1024")
    assert run.engine_options["max_num_seqs"] == 16 and run.prompt_len == 1024


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("-c", "1,x"), ("--concurrency", "'x' is not an integer")),
        (("-c", "300", "--max-num-seqs", "256"), ("exceeds --max-num-seqs 256",)),
        (("--bandwidth-gbs", "0"), ("--bandwidth-gbs must be > 0",)),
        (("--bandwidth-gbs", "fast"), ("--bandwidth-gbs",)),
        (("--decode-window", "0"), ("--decode-window must be >= 1",)),
        (("--attention-backend", "magic"), ("--attention-backend must be one of",)),
        (("--attention-backend", "flash"), ("flash",)),
    ],
)
def test_bad_new_flags_fail_with_one_line(tiny_ouro_dir: Path, args: tuple, needles: tuple) -> None:
    assert_one_error_line(run_tiny(tiny_ouro_dir, *args), *needles)


# The floor's arithmetic, by hand. Demo model (fp32): 3 layers of q 256x256, k and v 256x128,
# o 256x256, gate/up/down 3 x 256x768, 4 RMSNorms of 256 -> 787,456 params; plus the final norm
# (Ouro normalises every loop: 256) and the exit gate (256 + 1) -> 2,362,881 params x 4 bytes.
DEMO_STACK = 4 * (3 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 768 + 4 * 256) + 256 + 257)
DEMO_CODA = 4 * 4096 * 256  # lm_head


def test_weight_bytes_of_the_demo_model_by_hand() -> None:
    w = weight_bytes(load_model(DEMO_DIR, dtype=torch.float32))
    assert (w.layer_stack, w.coda, w.embedding_row) == (DEMO_STACK, DEMO_CODA, 4 * 256)
    assert DEMO_STACK == 9_451_524
    assert w.per_token_step(4) == 4 * 9_451_524 + 4_194_304 == 42_000_400


def test_floor_of_ouro_1_4b_matches_design(tmp_path: Path) -> None:
    """Weight-bandwidth floor: ~10.07 GB read per token step at 4 loops; at 4.27 TB/s the floor
    is 424 tok/s at c=1 and ~3,400 at c=8. Built on the meta device: no memory needed."""
    (tmp_path / "config.json").write_text((KNOWN_CONFIGS / "ouro-1.4b" / "config.json").read_text())
    config = load_config(tmp_path)
    with torch.device("meta"):
        model = model_class(config.model_type)(config)
    model.to(torch.bfloat16)
    w = weight_bytes(model)
    layer = 4 * 2048 * 2048 + 3 * 2048 * 5632 + 4 * 2048  # attention, SwiGLU, 4 norms
    assert w.layer_stack == 2 * (24 * layer + 2048 + 2049)  # + final norm + exit gate, bf16
    assert w.coda == 2 * 49152 * 2048
    step = w.per_token_step(4)
    assert step == 10_067_935_240
    assert floor_tokens_per_s(1, step, 4.27e12) == pytest.approx(424.12, abs=0.01)
    assert floor_tokens_per_s(8, step, 4.27e12) == pytest.approx(3392.95, abs=0.01)


def test_floor_arithmetic() -> None:
    assert floor_tokens_per_s(8, 2e9, 4e12) == 16_000.0  # 8 rows per 0.5 ms step
    assert floor_tokens_per_s(1, 1.0, 1.0) == 1.0
    with pytest.raises(ValueError, match="must be positive"):
        floor_tokens_per_s(1, 0, 1e12)
    base = torch.zeros(100)  # 400 bytes; overlapping views and repeats count once
    assert _distinct_bytes([base[:60], base[40:], base[:10], base]) == 400
    assert _distinct_bytes([torch.zeros(3), torch.zeros(5, dtype=torch.float16)]) == 22


def test_floor_loops() -> None:
    assert bench_cli.floor_loops({4: 10}, LoopControls(1, 4, 1.0)) == 4.0
    assert bench_cli.floor_loops({2: 9, 4: 1}, LoopControls(1, 2, 1.0)) == 2.0
    assert bench_cli.floor_loops({1: 1, 3: 3}, LoopControls(1, 4, 0.5)) == 2.5


def test_copy_bandwidth_needs_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        measure_copy_bandwidth(torch.device("cpu"))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_copy_bandwidth_on_cuda() -> None:
    bandwidth = measure_copy_bandwidth(torch.device("cuda"), nbytes=1 << 28, repeats=3)
    assert 1e10 < bandwidth < 2e13  # 10 GB/s .. 20 TB/s


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("eager", [False, True])
def test_bench_on_cuda_measures_bandwidth_and_memory(ckpt: Path, eager: bool) -> None:
    args = ["--model", str(ckpt), "--device", "cuda", "--dtype", "bfloat16", *TINY]
    result = invoke(*args, "-c", "1,2", "--json", *(["--enforce-eager"] if eager else []))
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["bandwidth_source"] == "measured" and data["bandwidth_gbs"] > 10
    assert data["enforce_eager"] is eager
    if eager:
        assert data["cuda_graphs"] is False
    for r in data["results"]:
        assert r["peak_memory_bytes"] >= r["memory_start_bytes"] > 0
        assert r["floor_tokens_per_s"] > 0 and r["floor_share"] > 0


def test_the_header_names_the_live_kernel_switches():
    from rlt_cli.bench import execution_text

    base = {
        "cuda_graphs": True,
        "enforce_eager": False,
        "attention_impl": "triton",
        "attention_backend": "auto",
        "decode_window": 8,
    }
    plain = "attention triton (auto), CUDA graphs, decode window 8"
    assert execution_text(base) == plain
    off = {"pdl": False, "small_gemm": "cublas", "fused_rows": False}
    assert execution_text({**base, "kernels": off}) == plain
    live = {"pdl": True, "small_gemm": "table", "fused_rows": True}
    assert execution_text({**base, "kernels": live}) == (
        f"{plain}, pdl, fused_rows, small GEMMs: table"
    )
    borrowed = {**live, "small_gemm": "table+ws", "small_gemm_table": "NVIDIA H200"}
    assert execution_text({**base, "kernels": borrowed}) == (
        f"{plain}, pdl, fused_rows, small GEMMs: table+ws (NVIDIA H200's)"
    )
