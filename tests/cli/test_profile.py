"""`rlt profile` on the bundled demo model, in-process through typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner, Result

from rlt_cli.main import app
from rlt_cli.output import stdout
from rlt_engine.profile.trace import load_trace

CPU = ("--model", "demo", "--dtype", "float32", "--device", "cpu", "--num-blocks", "128")
TINY = ("-c", "2", "--prompt-len", "6", "--output-len", "5", "--warmup", "1")
PHASES = (
    "schedule", "bookkeeping", "prefill", "sampling", "decode_window", "read_back", "update",
    "detokenize", "add_requests", "host_gaps",
)  # fmt: skip


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, ["profile", *args])


def test_json_phases_and_trace(tmp_path: Path) -> None:
    trace = tmp_path / "out" / "demo.json"
    result = invoke(*CPU, *TINY, "--trace-out", str(trace), "--top", "5", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # stdout holds the JSON object and nothing else
    assert data["trace"] == str(trace)
    events = load_trace(trace)["traceEvents"]
    assert any(e.get("name") == "rlt.decode_window" for e in events)
    assert data["concurrency"] == 2 and data["prompt_len"] == 6 and data["output_len"] == 5
    assert data["attention_impl"] == "torch" and data["decode_window"] == 8
    phases = {p["phase"]: p for p in data["phases"]}
    assert list(phases) == list(PHASES)
    assert data["phases_ms"] <= data["wall_ms"]
    assert sum(p["ms"] for p in data["phases"]) == pytest.approx(data["wall_ms"])
    assert data["host_gaps_ms"] == pytest.approx(data["wall_ms"] - data["phases_ms"])
    for name in ("decode_window", "prefill", "schedule", "read_back", "update", "detokenize"):
        assert phases[name]["ms"] > 0 and phases[name]["calls"] > 0, name
    assert all(0 <= p["share"] <= 1 for p in data["phases"])
    assert phases["decode_window"]["ms"] > phases["schedule"]["ms"]
    # the profiled run alone: 4 token steps x 4 loops need at least 16 traversals
    assert data["token_steps"] == 4 and data["decode_traversals"] >= 16
    assert data["engine_steps"] >= 1 and data["steps"] == data["engine_steps"]
    assert data["missing_markers"] == []
    assert (data["graphs_captured"], data["graph_capture_s"]) == (0, 0.0)  # no graphs on CPU
    assert data["decode_tokens_per_s"] > 0
    gpu = data["gpu"]
    assert gpu["available"] is False
    assert gpu["busy_share_decode_window"] is None and gpu["kernels_per_token_step"] is None
    assert gpu["sync_sites"] is None
    top = data["top"]
    assert top["kind"] == "cpu_ops" and 1 <= len(top["items"]) <= 5
    assert all(item["name"].startswith("aten::") for item in top["items"])


def test_human_summary_and_default_trace_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(stdout, "_width", 200)
    result = invoke(*CPU, *TINY)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "wall time by phase" in out and "decode_window" in out and "host_gaps" in out
    assert "GPU busy: n/a" in out and "CPU ops by self time" in out
    traces = list((tmp_path / "rlt-profile").glob("ouro-gsm8k-tiny-c2-*.json"))
    assert len(traces) == 1 and f"trace: {Path('rlt-profile') / traces[0].name}" in out


def assert_one_error_line(result: Result, *needles: str) -> None:
    assert result.exit_code not in (0, None), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("-c", "1,2"), ("--concurrency", "one workload")),
        (("-c", "0"), ("--concurrency must be >= 1",)),
        (("-c", "x"), ("--concurrency", "rlt profile --help")),
        (("--output-len", "1"), ("--output-len must be >= 2",)),
        (("--prompt-len", "0"), ("--prompt-len must be >= 1",)),
        (("--warmup", "-1"), ("--warmup must be >= 0",)),
        (("--top", "0"), ("--top must be >= 1",)),
        (("--repeats", "2"), ("--repeats",)),  # a bench flag profile does not take
        (("--no-such-flag",), ("--no-such-flag",)),
        (("--decode-window", "0"), ("--decode-window must be >= 1",)),
        (("--max-loops", "9"), ("model depth (4)",)),
        (("--prompt-len", "4000"), ("context",)),
    ],
)
def test_bad_flags_fail_with_one_line(args: tuple, needles: tuple) -> None:
    assert_one_error_line(invoke(*CPU, *TINY, *args), *needles)


def test_trace_out_must_be_a_file(tmp_path: Path) -> None:
    assert_one_error_line(invoke(*CPU, *TINY, "--trace-out", str(tmp_path)), "--trace-out")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("eager", [False, True])
def test_profile_on_cuda_reports_kernels_and_gpu_busy(
    ckpt: Path, tmp_path: Path, eager: bool
) -> None:
    args = ["--model", str(ckpt), "--device", "cuda", "--dtype", "bfloat16", *TINY]
    args += ["--trace-out", str(tmp_path / "t.json.gz"), "--json"]
    result = invoke(*args, *(["--enforce-eager"] if eager else []))
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    gpu = data["gpu"]
    assert gpu["available"] is True and gpu["kernels"] >= gpu["decode_kernels"] > 0
    assert 0 < gpu["busy_share_decode_window"] <= 1 and 0 < gpu["busy_share_wall"] <= 1
    assert gpu["kernels_per_token_step"] > 0 and gpu["launch_calls"] > 0
    # at least the read backs wait for the GPU
    assert any(site["phase"] == "read_back" for site in gpu["sync_sites"])
    phases = {p["phase"]: p for p in data["phases"]}
    assert phases["decode_window"]["gpu_ms"] > 0
    assert data["top"]["kind"] == "cuda_kernels" and data["top"]["items"]
    assert data["phases_ms"] <= data["wall_ms"]
    # the decode chain: links between the decode windows' kernels, named with their grids
    chain = data["chain"]
    assert chain["items"] and 0 < chain["added_ms"] <= gpu["busy_ms"]
    assert sum(i["calls"] for i in chain["items"]) <= gpu["decode_kernels"]
    assert any(i["kernel"].endswith("]") for i in chain["items"])
    # its cadence: a layer run's added time, against the layer's weights at the copy rate
    assert chain["cadence"]["layer_us"] > 0 and chain["cadence"]["layer_runs"] > 0
    assert data["bandwidth_gbs"] > 0 and data["layer_weight_bytes"] > 0


def test_the_cadence_line_sets_a_layer_run_against_its_weights_at_the_copy_rate() -> None:
    from rlt_cli.profile import _cadence_line

    cadence = {"layer_runs": 2976, "layer_us": 50.0, "traversal_us": 26.7, "other_ms": 0.03}
    report = {"chain": {"items": [], "cadence": cadence}, "layer_weight_bytes": 102.8e6,
              "bandwidth_gbs": 2970.0}  # fmt: skip
    line = _cadence_line(report)
    assert "a layer run adds 50.0 us (2,976 runs)" in line
    assert "102.8 MB, take 34.6 us at the copy rate (2.97 TB/s), 69.2% of it" in line
    assert "26.7 us" in line and "0.03 ms" in line
    # without a measured copy rate (CPU) only the cadence; without a cadence nothing
    assert "copy rate" not in _cadence_line({**report, "bandwidth_gbs": None})
    assert _cadence_line({"chain": {"items": [], "cadence": None}}) is None


def test_the_chain_table_shows_each_link() -> None:
    """The human form of the decode chain: one row a link, the kernel before it and the
    kernel with its grid, its added time, share, calls and median."""
    from rich.console import Console

    from rlt_cli.profile import _chain_table

    chain = {
        "added_ms": 3.0,
        "items": [
            {"after": "_add_rms_norm_kernel [1, 1, 1]", "kernel": "ws_gemm_kernel [96, 1, 1]",
             "calls": 96, "added_ms": 2.0, "added_median_us": 10.14, "added_share": 2 / 3},
            {"after": "(first)", "kernel": "_prepare_kernel [1, 1, 1]", "calls": 4,
             "added_ms": 1.0, "added_median_us": 7.2, "added_share": 1 / 3},
        ],
    }  # fmt: skip
    console = Console(width=200, record=True)
    console.print(_chain_table(chain, width=200))
    text = console.export_text()
    assert "decode chain" in text and "3.0 ms in all" in text
    assert "_add_rms_norm_kernel [1, 1, 1]" in text and "ws_gemm_kernel [96, 1, 1]" in text
    assert "10.14" in text and "66.7%" in text and "(first)" in text
    # on an 80-column terminal the names are cut, their grids kept, and every number stays
    # (Rich dropped the number columns rather than cut names it may not wrap)
    console = Console(width=80, record=True)
    console.print(_chain_table(chain, width=80))
    lines = console.export_text().splitlines()
    assert max(map(len, lines[:4])) <= 80
    assert "10.14" in lines[2] and "66.7%" in lines[2] and "96" in lines[2]
    assert "_add_rms_n… [1, 1, 1]" in lines[2] and "ws_gemm_k… [96, 1, 1]" in lines[2]


def test_short_chain_keys_keep_their_grid() -> None:
    from rlt_cli.profile import _short_key

    assert _short_key("ws_gemm_kernel [88, 1, 1]", 25) == "ws_gemm_kernel [88, 1, 1]"
    assert _short_key("ws_gemm_kernel [88, 1, 1]", 21) == "ws_gemm_k… [88, 1, 1]"
    assert _short_key("ws_gemm_kernel [88, 1, 1]", 10) == "ws_gemm_k…"  # no room for the grid
    assert _short_key("void at::native::vectorized_elementwise_kernel<2>", 12) == "void at::na…"


def test_tables_of_numbers_print_at_their_natural_width_on_a_narrow_terminal() -> None:
    """`print_table`: a bench table wider than an 80-column terminal keeps every number
    whole (Rich fitted it to 80 columns: '1629…' tok/s); the terminal wraps its lines."""
    import io

    from rich.console import Console
    from rich.table import Table

    import rlt_cli.output as output

    table = Table(box=None)
    for name in ("concurrency", "tok/s", "floor", "% floor", "TTFT p50", "TTFT p90", "E2E p50"):
        table.add_column(name, justify="right")
    table.add_row("256", "19654.2", "75,999", "25.9%", "265.6 ms", "481.7 ms", "864.7 ms")
    saved = output.stdout
    output.stdout = Console(width=40, file=io.StringIO(), highlight=False, soft_wrap=True)
    try:
        output.print_table(table)
        text = output.stdout.file.getvalue()
        assert output.stdout.width == 40  # put back
    finally:
        output.stdout = saved
    assert "19654.2" in text and "concurrency" in text and "864.7 ms" in text and "…" not in text
