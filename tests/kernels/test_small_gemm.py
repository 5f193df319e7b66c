"""Small-M Triton GEMM (kernels/small_gemm.py) against fp64 / torch fp32 matmul.

Without CUDA the kernel runs under the Triton interpreter on small shapes (conftest.py here sets
TRITON_INTERPRET=1 before triton is imported). The kernel accumulates in fp32 and rounds once,
so its result is the exact product up to fp32 accumulation error, then one rounding to the
output dtype. Asserted per element: |out - exact| <= ulp(out dtype at |exact|) + 2^-22 *
sum_k |x w| (the second term bounds the fp32 accumulation), and bf16 / fp16 outputs within 1 ulp
of torch's fp32 matmul rounded to that dtype wherever that term is under a quarter ulp (in
elements with heavy cancellation both differ from the exact value by more: measured 2 ulps).

GPU tests (Ouro-1.4B / Nanbeige shapes, graph capture = eager, run-to-run bitwise determinism
of the split-K ticket reduction): pytest tests/kernels/test_small_gemm.py -m gpu -s
"""

from __future__ import annotations

import importlib
import json

import benchmark_scripts
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from rlt_engine.kernels import argmax, small_gemm
from rlt_engine.kernels.small_gemm import (
    GemmConfig,
    choose,
    gemm,
    linear,
    linear_argmax,
    lookup,
    m_bucket,
    supported,
    table_key,
)
from rlt_engine.kernels.small_gemm_tables import FIELDS, TABLES, module_name, table_of
from rlt_engine.kernels.ws_gemm import check as ws_check

TABLE = table_of("NVIDIA H200")  # the committed table the CPU tests read

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
ACC_TOL = 2.0**-22  # times sum_k |x_k w_k|: fp32 accumulation error bound
# Hopper's tensor cores add the products of an MMA with less than round-to-nearest fp32 (cuBLAS
# too): measured 1.8e-5 over the CPU bound at K = 10752; the GPU tests allow 4x the term.
ACC_TOL_GPU = 2.0**-20
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def make(m: int, n: int, k: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.5).to(dtype)
    return x.to(device), w.to(device)


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, acc_tol: float = ACC_TOL) -> float:
    """Assert the bound above; return the worst error as a share of the bound."""
    x64, w64 = x.double().cpu(), w.double().cpu()
    exact = x64 @ w64.T
    absprod = x64.abs() @ w64.abs().T
    got = out.double().cpu()
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - MANTISSA[out.dtype])
    err = (got - exact).abs()
    bound = ulp + acc_tol * absprod
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    if out.dtype != torch.float32:  # where fp32 accumulation cannot move the rounding much
        torch32 = (x.float() @ w.float().T).to(out.dtype)
        tame = (acc_tol * absprod <= ulp / 4).to(out.device)
        assert ulps(out, torch32)[tame].max().item() <= 1
    return float((err / bound).max())


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place of a 16-bit dtype (ordered bit patterns)."""
    ia, ib = a.view(torch.int16).long(), b.view(torch.int16).long()
    ia = torch.where(ia < 0, -(ia + (1 << 15)), ia)
    ib = torch.where(ib < 0, -(ib + (1 << 15)), ib)
    return (ia - ib).abs()


def test_supported_cpu():
    ok, why = supported(torch.device("cpu"))
    assert ok, why


# (m, n, k, config): M = 1 and non-multiples of BLOCK_M (16), N and K not multiples of their
# blocks, K not a multiple of the split (200 = 3 splits of 96, 96, 8), one split per block.
CASES = [
    (1, 96, 200, GemmConfig(block_n=32, block_k=32, split_k=3)),
    (3, 64, 256, GemmConfig(block_n=16, block_k=64, split_k=1)),
    (17, 80, 96, GemmConfig(block_n=32, block_k=32, split_k=2)),
    (33, 48, 130, GemmConfig(block_n=16, block_k=32, split_k=5)),
    (64, 32, 64, GemmConfig(block_n=32, block_k=16, split_k=4)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "k", "config"), CASES)
def test_matches_reference(m, n, k, config, dtype):
    x, w = make(m, n, k, dtype, seed=m)
    out = gemm(x, w, config)
    assert out.shape == (m, n) and out.dtype == dtype
    check(out, x, w)
    if dtype == torch.float32:
        torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-5)


def test_deterministic_and_counters_reset():
    x, w = make(5, 96, 200, torch.bfloat16, seed=1)
    config = GemmConfig(block_n=32, block_k=32, split_k=4)
    first = gemm(x, w, config)
    for _ in range(3):
        assert torch.equal(gemm(x, w, config), first)
    assert int(small_gemm._counters(x.device).abs().sum()) == 0


def test_split_counts_agree():
    x, w = make(7, 64, 192, torch.float32, seed=2)
    outs = [gemm(x, w, GemmConfig(block_n=32, block_k=32, split_k=s)) for s in (1, 2, 6, 99)]
    for out in outs:
        check(out, x, w)
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-5)


def test_views_lead_dims_and_empty():
    x, w = make(6, 48, 64, torch.bfloat16, seed=3)
    config = GemmConfig(block_n=16, block_k=32, split_k=2)
    want = gemm(x, w, config)
    wide = torch.zeros(6, 100, dtype=torch.bfloat16)
    wide[:, 20:84] = x
    assert torch.equal(gemm(wide[:, 20:84], w, config), want)  # rows with a stride
    assert torch.equal(gemm(x.view(2, 3, 64), w, config), want.view(2, 3, 48))
    assert gemm(x[:0], w, config).shape == (0, 48)


def test_rejects_bad_arguments():
    x, w = make(3, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="share a dtype"):
        gemm(x, w.bfloat16(), GemmConfig())
    with pytest.raises(ValueError, match="contiguous"):
        gemm(x[:, :32], w.t().contiguous()[:32].t(), GemmConfig())
    with pytest.raises(ValueError, match="at most"):
        gemm(torch.zeros(65, 64), w, GemmConfig())


@pytest.mark.parametrize("split_k", [1, 3])
def test_gate_skips_the_gemm_or_runs_it_unchanged(split_k):
    """An open gate (any non-zero value) gives the ungated result bit for bit; a closed one
    writes nothing (the output keeps whatever the buffer held) and leaves the counters at 0."""
    x, w = make(5, 96, 200, torch.bfloat16, seed=4)
    config = GemmConfig(block_n=32, block_k=32, split_k=split_k)
    want = gemm(x, w, config)
    for on in (torch.tensor(True), torch.tensor(7, dtype=torch.int32)):
        assert torch.equal(gemm(x, w, config, gate=on), want)
    closed = gemm(x, w, config, gate=torch.tensor(False))
    assert closed.shape == want.shape  # contents undefined: nothing to compare
    assert int(small_gemm._counters(x.device).abs().sum()) == 0
    assert torch.equal(gemm(x, w, config), want)  # and the next launch is unaffected
    with pytest.raises(ValueError, match="gate must be one element"):
        gemm(x, w, config, gate=torch.ones(2, dtype=torch.bool))


def test_gated_dispatch_takes_the_kernel_where_the_table_prefers_cublas():
    """A gated GEMM on a shape whose entry says cuBLAS still gets the entry's Triton config
    (the skip is worth more than the few percent); an ungated one stays on cuBLAS."""
    entries = {"64x32:m4:bfloat16": ("cublas", 32, 32, 1, 4, 2, 5.0, 4.9)}
    assert lookup(entries, 64, 32, 3, torch.bfloat16) is None
    assert lookup(entries, 64, 32, 3, torch.bfloat16, gated=True) == GemmConfig(32, 32, 1, 4, 2)
    assert lookup(entries, 64, 32, 9, torch.bfloat16, gated=True) is None  # no entry: cuBLAS
    x, w = make(4, 32, 64, torch.float32)
    assert torch.equal(linear(x, w, gate=torch.tensor(False)), F.linear(x, w))  # CPU: runs


def test_the_table_serves_its_gpu_and_those_of_the_same_layout_on_its_triton():
    table = {"device": "NVIDIA H200", "capability": "9.0", "sms": 132, "triton": "3.6.0"}
    assert small_gemm.table_applies(table, "NVIDIA H200", "9.0", 132, "3.6.0")
    assert small_gemm.table_applies(table, "NVIDIA H100 80GB HBM3", "9.0", 132, "3.6.0")
    assert not small_gemm.table_applies(table, "NVIDIA H200", "9.0", 132, "3.5.1")
    assert not small_gemm.table_applies(table, "NVIDIA H100 PCIe", "9.0", 114, "3.6.0")
    assert not small_gemm.table_applies(table, "NVIDIA A100-SXM4-80GB", "8.0", 108, "3.6.0")
    assert not small_gemm.table_applies(table, "NVIDIA H200", "9.0", 132, None)  # no triton
    legacy = {"device": "NVIDIA H200", "triton": "3.6.0"}  # a table without the layout
    assert small_gemm.table_applies(legacy, "NVIDIA H200", "9.0", 132, "3.6.0")
    assert not small_gemm.table_applies(legacy, "NVIDIA H100 80GB HBM3", "9.0", 132, "3.6.0")
    for committed in TABLES:  # each names its layout and lives in its GPU's module
        assert {"capability", "sms"} <= set(committed)
        assert table_of(committed["device"]) is committed
        module = importlib.import_module(
            f"rlt_engine.kernels.small_gemm_tables.{module_name(committed['device'])}"
        )
        assert module.TABLE is committed
    assert module_name("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"


def test_a_gpu_takes_its_own_table_before_one_of_its_layout():
    h200 = {"device": "NVIDIA H200", "capability": "9.0", "sms": 132, "triton": "3.6.0"}
    h100 = {**h200, "device": "NVIDIA H100 80GB HBM3"}
    old = {**h100, "triton": "3.5.1"}
    for tables in ((h200, h100), (h100, h200)):
        assert small_gemm.pick_table(tables, "NVIDIA H200", "9.0", 132, "3.6.0") is h200
        assert small_gemm.pick_table(tables, "NVIDIA H100 80GB HBM3", "9.0", 132, "3.6.0") is h100
    assert small_gemm.pick_table((h200,), "NVIDIA H100 80GB HBM3", "9.0", 132, "3.6.0") is h200
    # its own table tuned on another Triton does not apply; one of its layout does
    assert small_gemm.pick_table((old, h200), "NVIDIA H100 80GB HBM3", "9.0", 132, "3.6.0") is h200
    assert small_gemm.pick_table((h200,), "NVIDIA H100 PCIe", "9.0", 114, "3.6.0") is None
    # the committed tables: an H100 SXM on the H200 table's Triton takes it
    sxm = small_gemm.pick_table(TABLES, "NVIDIA H100 80GB HBM3", "9.0", 132, TABLE["triton"])
    assert sxm is (table_of("NVIDIA H100 80GB HBM3") or TABLE)
    assert small_gemm.serving_table(torch.device("cpu")) is None


def test_dispatch_mode_says_what_runs(monkeypatch):
    """cuBLAS off CUDA and where no table was tuned for the GPU; "+ws" only where the table
    has warp-specialised rows and that kernel runs on the device."""
    from rlt_engine.kernels import ws_gemm

    cuda = torch.device("cuda", 0)
    assert small_gemm.dispatch_mode(torch.device("cpu")) == "cublas"
    monkeypatch.setattr(small_gemm, "_TABLES", {0: None})  # another GPU model
    assert small_gemm.dispatch_mode(cuda) == "cublas"
    rows = {"64x32:m1:bfloat16": ("triton", 32, 32, 1, 4, 2, 5.0, 6.0)}
    monkeypatch.setattr(small_gemm, "_TABLES", {0: rows})
    monkeypatch.setattr(ws_gemm, "_AVAILABLE", {0: True})
    assert small_gemm.dispatch_mode(cuda) == "table"
    rows["64x32:m8:bfloat16"] = ("ws", 64, 32, 1, 4, 3, 4.0, 6.0)
    assert small_gemm.dispatch_mode(cuda) == "table+ws"
    monkeypatch.setattr(ws_gemm, "_AVAILABLE", {0: False})  # a table row it cannot run
    assert small_gemm.dispatch_mode(cuda) == "table"
    monkeypatch.setattr(small_gemm, "_PREFER_TRITON", True)
    assert small_gemm.dispatch_mode(cuda) == "triton"
    monkeypatch.setattr(small_gemm, "_DISABLED", True)
    assert small_gemm.dispatch_mode(cuda) == "cublas"


def test_linear_falls_back_to_cublas_off_the_table():
    """CPU tensors, M > 64, fp32 and unknown shapes go to F.linear: bitwise torch's result."""
    x, w = make(4, 32, 64, torch.float32)
    assert choose(x, w) is None
    assert torch.equal(linear(x, w), F.linear(x, w))
    big = torch.randn(80, 64)
    assert torch.equal(linear(big, w), F.linear(big, w))


def test_table_keys_and_entries():
    assert [m_bucket(m) for m in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert table_key(6144, 2048, 5, torch.bfloat16) == "6144x2048:m8:bfloat16"
    assert FIELDS[0] == "backend" and FIELDS[1:6] == tuple(vars(GemmConfig()))[:5]
    for key, row in TABLE["entries"].items():
        assert "float32" not in key, "fp32 stays cuBLAS (exact tiny-checkpoint outputs)"
        assert len(row) == len(FIELDS) and row[0] in ("triton", "ws", "cublas"), key
        shape, bucket, dtype = key.split(":")
        n, k, m = *map(int, shape.split("x")), int(bucket[1:])
        config = lookup(TABLE["entries"], n, k, m, getattr(torch, dtype))
        assert (config is None) == (row[0] == "cublas"), key
        if config is not None:
            assert config.block_n >= 16 and config.block_k >= 16 and config.split_k >= 1
            assert row[6] < row[7], f"{key}: chosen although slower than cuBLAS"
            assert config.kernel == ("ws" if row[0] == "ws" else "triton"), key
            if config.kernel == "ws":
                why = ws_check(n, k, m, config.block_n, config.block_k, config.split_k)
                assert why is None, f"{key}: {why}"
    assert lookup(TABLE["entries"], 6144, 2048, 3, torch.float16) is None  # not tuned: cuBLAS


def _model_forms() -> tuple[dict, set]:
    """The packed qkv (with their head dim) and gate/up weight shapes (N, K) of the models the
    table is tuned for, as the tuner derives them (bench_small_gemm.model_shapes)."""
    bench = benchmark_scripts.load("bench_small_gemm")
    shapes = bench.model_shapes()
    qkv, gate_up = {}, set()
    for model, path in bench.MODELS.items():
        head_dim = json.loads((bench.ROOT / path / "config.json").read_text())["head_dim"]
        qkv[shapes[f"{model}/qkv"]] = head_dim
        gate_up.add(shapes[f"{model}/gate_up"])
    return qkv, gate_up


def test_every_ws_row_launches_in_the_form_its_model_calls_it():
    """A shipped "ws" row fits a block's shared memory with its ring (else the launch raises
    during capture, found only on a GPU), in the SwiGLU form for a packed gate/up, and with
    the RoPE epilogue's exchange for a packed qkv (else `linear_rope` declines it and decode
    silently takes the separate RoPE launch)."""
    qkv, gate_up = _model_forms()
    assert (6144, 2048) in qkv and (21504, 3072) in gate_up
    seen = set()
    for key, row in TABLE["entries"].items():
        if row[0] != "ws":
            continue
        shape, bucket, _ = key.split(":")
        n, k, m = *map(int, shape.split("x")), int(bucket[1:])
        _, block_n, block_k, split, _, stages = row[:6]
        swiglu, rope = (n, k) in gate_up, (n, k) in qkv
        why = ws_check(n, k, m, block_n, block_k, split, swiglu, stages, rope)
        assert why is None, f"{key}: {why}"
        if rope:  # the epilogue's tiles hold whole RoPE pairs (as ws_gemm.check_rope)
            assert qkv[n, k] % block_n == 0 and block_n % 16 == 0, key
        seen.add((swiglu, rope))
    assert seen >= {(True, False), (False, True), (False, False)}


# -- GPU -----------------------------------------------------------------------------------------

OURO = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
NANBEIGE_DOWN = (3072, 10752)


@gpu
@needs_cuda
@pytest.mark.parametrize("name", [*OURO, "nanbeige_down", "lm_head"])
@pytest.mark.parametrize("m", [1, 8, 64])
def test_gpu_model_shapes(name, m):
    n, k = {**OURO, "nanbeige_down": NANBEIGE_DOWN, "lm_head": (49152, 2048)}[name]
    x, w = make(m, n, k, torch.bfloat16, device="cuda", seed=m)
    worst = 0.0
    for config in (GemmConfig(64, 128, 1), GemmConfig(64, 128, 4), GemmConfig(128, 64, 8)):
        out = gemm(x, w, config)
        worst = max(worst, check(out, x, w, ACC_TOL_GPU))
        assert torch.equal(gemm(x, w, config), out)
    cublas = check(F.linear(x, w), x, w, ACC_TOL_GPU)
    print(f"\nsmall_gemm {name} m={m}: worst error {worst:.3f} of the bound (cuBLAS {cublas:.3f})")


def assert_deterministic_under_contention(configs: tuple[GemmConfig, ...]) -> None:
    """Many splits per tile race for the last ticket; the sum order must not depend on it:
    each config within the bound, 50 launches bitwise equal, the counters left zero."""
    x, w = make(8, 2048, 5632, torch.bfloat16, device="cuda", seed=4)
    for config in configs:
        first = gemm(x, w, config)
        check(first, x, w, ACC_TOL_GPU)
        for _ in range(50):
            assert torch.equal(gemm(x, w, config), first)
    assert int(small_gemm._counters(x.device).abs().sum()) == 0


@gpu
@needs_cuda
def test_gpu_deterministic_under_contention():
    assert_deterministic_under_contention((GemmConfig(64, 128, 11), GemmConfig(64, 64, 16)))


@gpu
@needs_cuda
def test_gpu_cuda_graph_equals_eager():
    shapes = list(OURO.values())
    weights = [
        make(1, n, k, torch.bfloat16, device="cuda", seed=i)[1] for i, (n, k) in enumerate(shapes)
    ]
    configs = [
        GemmConfig(64, 128, 4),
        GemmConfig(64, 128, 8),
        GemmConfig(128, 128, 1),
        GemmConfig(64, 256, 6),
    ]
    static_x = [torch.zeros(8, k, dtype=torch.bfloat16, device="cuda") for _, k in shapes]

    def step() -> list[torch.Tensor]:
        return [gemm(x, w, c) for x, w, c in zip(static_x, weights, configs, strict=True)]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (11, 12):
        xs = [make(8, 1, k, torch.bfloat16, device="cuda", seed=seed)[0] for _, k in shapes]
        for static, new in zip(static_x, xs, strict=True):
            static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        for out, x, w, c in zip(outs, xs, weights, configs, strict=True):
            assert torch.equal(out, gemm(x, w, c))


@gpu
@needs_cuda
def test_gpu_linear_uses_the_table():
    table = small_gemm.serving_table(torch.device("cuda"))
    if table is None:
        pytest.skip("no table serves this GPU")
    keys = [key for key, row in table["entries"].items() if row[0] == "triton"]
    for key in keys[:: max(1, len(keys) // 8)]:
        shape, bucket, dtype = key.split(":")
        n, k = map(int, shape.split("x"))
        x, w = make(int(bucket[1:]), n, k, getattr(torch, dtype), device="cuda")
        assert choose(x, w) is not None, key
        check(linear(x, w), x, w, ACC_TOL_GPU)


def _tied_logits(x: torch.Tensor, w: torch.Tensor) -> None:
    """Ties, infinities and NaNs in x @ w.T: w's rows 1, 2 and the last copy row 0 (ties
    inside a tile and across tiles); w[4, 0] = inf makes logit 4 +inf or -inf by the sign of
    x[r, 0], and NaN in row 2 (x[2, 0] = 0); x's row 1 holds a NaN (a row of NaN logits)."""
    w[1:3] = w[0]
    w[-1] = w[0]
    w[4, 0] = float("inf")
    x[2, 0] = 0.0
    x[1, 3] = float("nan")


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's inf * 0
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "block_n"), [(1, 96, 64, 32), (5, 100, 70, 16)])
def test_argmax_epilogue_equals_the_argmax_of_the_output(m, n, k, block_n, dtype):
    """The epilogue's partials (one per N tile) reduce to torch's argmax of the GEMM's own
    output, ties (the first index), NaNs (the first NaN) and a partial last tile included;
    a closed gate writes nothing and raises nothing."""
    x, w = make(m, n, k, dtype, seed=n)
    if m > 2:
        _tied_logits(x, w)
    config = GemmConfig(block_n=block_n, block_k=32, split_k=1)
    partials = gemm(x, w, config, argmax=True)
    assert partials.best.shape == partials.index.shape == (m, -(-n // block_n))
    want = gemm(x, w, config).float().argmax(-1)
    assert torch.equal(argmax.reduce_reference(partials), want)
    gemm(x, w, config, gate=torch.tensor(False), argmax=True)


def test_argmax_epilogue_refuses_split_k_and_linear_argmax_falls_back():
    x, w = make(3, 64, 96, torch.bfloat16, seed=5)
    with pytest.raises(ValueError, match="without split-K"):
        gemm(x, w, GemmConfig(block_n=32, block_k=32, split_k=2), argmax=True)
    # off the table (CPU): the logits through cuBLAS / torch, then the argmax's partials
    got = argmax.reduce_reference(linear_argmax(x, w))
    assert torch.equal(got, F.linear(x, w).float().argmax(-1))


_COMPILE = """
from rlt_engine.kernels import small_gemm

small_gemm._import_triton()
fn = small_gemm._compiled(False)
sig = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")}
sig |= {"ws_ptr": "*fp32", "count_ptr": "*i32", "gate_ptr": "*i32", "best_ptr": "*fp32",
        "best_i_ptr": "*i32"}
const = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT=False, GATED=True, EVEN_N=True,
             EVEN_K=True, UPCAST=False, ROUND_BF16=False, PDL=True, LINE=64)
out = {}
for argmax in (False, True):
    ptx = triton_ptx(fn, const | dict(ARGMAX=argmax), sig, num_warps=4, num_stages=4)
    out[str(argmax)] = ptxas_usage(ptx) + [ptx.count("st.global")]
print(json.dumps(out))
"""


def test_argmax_epilogue_compiles_for_sm90_in_the_plain_kernels_registers():
    """The Ouro lm_head's config with the epilogue builds for sm_90 without spills and with no
    more registers than without it; it stores 2 values a row (best, index), not the tile."""
    from sm90_compile import TRITON_PTX, run_compile_script

    plain, argmax_ = run_compile_script(TRITON_PTX + _COMPILE).values()
    assert argmax_[1] == plain[1] == 0
    assert argmax_[0] <= plain[0]
    assert argmax_[2] == 2 < plain[2]


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
def test_gpu_lm_head_argmax_epilogue_under_a_graph(m):
    """The Ouro lm_head in bf16 through `linear_argmax` inside a CUDA graph (the epilogue
    where the table gives the Triton kernel): the argmax of the kernel's own logits, bit for
    bit, and a closed gate skips it."""
    x, w = make(m, 49152, 2048, torch.bfloat16, device="cuda", seed=17)
    gate = torch.ones(1, dtype=torch.int32, device="cuda")
    linear_argmax(x, w, gate)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        partials = linear_argmax(x, w, gate)
    graph.replay()
    torch.cuda.synchronize()
    want = linear(x, w, gate).float().argmax(-1)
    assert torch.equal(argmax.reduce_reference(partials), want)
    config = choose(x, w, gated=True)
    print(f"lm_head m={m}: {config}, partials {tuple(partials.best.shape)}")


@gpu
@needs_cuda
def test_gpu_gated_lm_head_under_a_graph():
    """The lm_head shape gated inside one CUDA graph: an open gate replays the eager result,
    a closed one leaves the previous replay's output in place (nothing written)."""
    x, w = make(8, 49152, 2048, torch.bfloat16, device="cuda", seed=13)
    config = lookup(TABLE["entries"], 49152, 2048, 8, torch.bfloat16, gated=True)
    config = config or GemmConfig(64, 128, 1)
    gate = torch.ones((), dtype=torch.bool, device="cuda")
    gemm(x, w, config, gate)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm(x, w, config, gate)
    graph.replay()
    torch.cuda.synchronize()
    want = gemm(x, w, config)
    assert torch.equal(out, want)
    gate.fill_(False)
    x.copy_(make(8, 1, 2048, torch.bfloat16, device="cuda", seed=14)[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)  # skipped: still the open replay's values
    gate.fill_(True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemm(x, w, config))
    assert int(small_gemm._counters(x.device).abs().sum()) == 0


@gpu
@needs_cuda
def test_gpu_prefetch_whole_takes_the_kernel_up_to_16_rows_and_changes_no_bit():
    """`linear(..., prefetch_whole=True)` (the o_proj after decode attention): the table's
    Triton config up to PREFETCH_WHOLE_MAX_M rows even where its entry says cuBLAS, the same
    bits as that config without the prefetch; cuBLAS's result above."""
    table = small_gemm.serving_table(torch.device("cuda"))
    if table is None:
        pytest.skip("no table serves this GPU")
    for m in (1, 8, 16):
        x, w = make(m, 2048, 2048, torch.bfloat16, device="cuda", seed=m)
        config = lookup(table["entries"], 2048, 2048, m, torch.bfloat16, gated=True)
        assert config is not None
        want = gemm(x, w, config)
        for _ in range(3):
            assert torch.equal(linear(x, w, prefetch_whole=True), want)
    x, w = make(32, 2048, 2048, torch.bfloat16, device="cuda", seed=32)
    assert torch.equal(linear(x, w, prefetch_whole=True), linear(x, w))
