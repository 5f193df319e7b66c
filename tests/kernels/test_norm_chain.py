"""The fused add + RMSNorm chain (kernels/norm_chain.py) against its unfused form: two launches
of kernels/norm.rms_norm (Ouro's sandwich: x = residual + norm_a(y), h = norm_b(x)) or a torch
add and one rms_norm (pre-norm: x = residual + y). Both results must be bit-identical
(atol = rtol = 0) in every dtype, on the interpreter and on the GPU; the exit hazard the same
launch can add, within a few fp32 ulps of torch's gate.

GPU tests (Ouro / Nanbeige shapes, CUDA graphs): pytest tests/kernels/test_norm_chain.py -m gpu
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlt_engine.kernels.norm import rms_norm
from rlt_engine.kernels.norm_chain import add_rms_norm, add_rms_norm_hazard, add_rms_norm_reference
from rlt_engine.kernels.split_sums import SplitSums

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make(rows: int, hidden: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    y = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    res = (torch.randn(rows, hidden, generator=gen) * 2).to(dtype)
    wa = (torch.randn(hidden, generator=gen) * 0.5 + 1.0).to(dtype)
    wb = (torch.randn(hidden, generator=gen) * 0.5 + 1.0).to(dtype)
    return [t.to(device) for t in (y, res, wa, wb)]


def unfused(y, res, wb, eps_b, wa=None, eps_a=None):
    """What the layers launch without the chain kernel."""
    x = res + y if wa is None else rms_norm(y, wa, eps_a, residual=res)
    return x, rms_norm(x, wb, eps_b)


def exact(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 96, 256])
def test_sandwich_bit_identical_to_two_launches(dtype, hidden):
    y, res, wa, wb = make(7, hidden, dtype)
    got = add_rms_norm(y, res, wb, 1e-6, y_weight=wa, y_eps=1e-5)
    exact(got, unfused(y, res, wb, 1e-6, wa, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 200])
def test_pre_norm_bit_identical_to_add_then_norm(dtype, hidden):
    y, res, _, wb = make(5, hidden, dtype, seed=1)
    exact(add_rms_norm(y, res, wb, 1e-6), unfused(y, res, wb, 1e-6))


def test_reference_is_the_torch_semantics():
    y, res, wa, wb = make(4, 64, torch.float32, seed=2)
    x, h = add_rms_norm_reference(y, res, wb, 1e-6, wa, 1e-6)
    torch.testing.assert_close(x, rms_norm(y, wa, 1e-6, residual=res), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(h, rms_norm(x, wb, 1e-6), atol=1e-6, rtol=1e-6)


def test_strided_rows_batch_invariant_and_empty():
    y, res, wa, wb = make(6, 48, torch.bfloat16, seed=3)
    wide = torch.zeros(6, 80, dtype=torch.bfloat16)
    wide[:, 8:56] = y
    exact(add_rms_norm(wide[:, 8:56], res, wb, 1e-6, wa), unfused(y, res, wb, 1e-6, wa, 1e-6))
    x, h = add_rms_norm(y, res, wb, 1e-6, wa)
    x1, h1 = add_rms_norm(y[3:4], res[3:4], wb, 1e-6, wa)
    assert torch.equal(x1[0], x[3]) and torch.equal(h1[0], h[3])
    x0, h0 = add_rms_norm(y[:0], res[:0], wb, 1e-6, wa)
    assert x0.shape == h0.shape == (0, 48)


def test_rejects_bad_arguments():
    y, res, wa, wb = make(3, 48, torch.float32)
    with pytest.raises(ValueError, match="residual must be"):
        add_rms_norm(y, res[:2], wb, 1e-6)
    with pytest.raises(ValueError, match="weights must be"):
        add_rms_norm(y, res, wb[:8], 1e-6)
    with pytest.raises(ValueError, match="weights must be"):
        add_rms_norm(y, res, wb, 1e-6, y_weight=wa[:8])
    with pytest.raises(ValueError, match="y must be"):
        add_rms_norm(y[None], res[None], wb, 1e-6)
    # a timer probe needs a PDL build (CUDA, sm_90+), never the interpreter
    with pytest.raises(ValueError, match="probe must be"):
        add_rms_norm(y, res, wb, 1e-6, probe=torch.zeros(3, 4, dtype=torch.int64))


# -- y as a split-K GEMM's unsummed partials (kernels/split_sums) ---------------------------------


def split_sums(rows: int, hidden: int, splits: int, dtype, device: str = "cpu", seed: int = 7):
    """Partials whose sum lands on rounding ties and signed zeros often: the order and the
    single rounding are what the test can see."""
    gen = torch.Generator().manual_seed(seed)
    parts = torch.randn(splits, rows, hidden, generator=gen) * 4
    parts[:, :, ::5] = parts[:, :, ::5].to(torch.bfloat16).float()  # exact in bf16: ties
    parts[0, :, 1::7] = -0.0
    parts[1:, :, 1::7] = 0.0  # a sum of -0.0 and +0.0: the start from 0.0 decides its sign
    parts[1:, :, 2::9] *= 1e-8  # small addends the order and the single rounding can lose
    return SplitSums(parts.to(device), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_split_sums_are_the_gemms_sum_bit_for_bit(dtype, splits):
    """add_rms_norm of a SplitSums = add_rms_norm of its sum as the GEMM rounds it (0.0 + p0 +
    p1 + ... in fp32, once to the dtype), x, h and the hazard; the reference agrees."""
    y = split_sums(5, 96, splits, dtype)
    _, res, wa, wb = make(5, 96, dtype, seed=4)
    summed = y.total()
    assert summed.dtype == dtype and y.shape == summed.shape == (5, 96)
    exact(add_rms_norm(y, res, wb, 1e-6, wa, 1e-5), add_rms_norm(summed, res, wb, 1e-6, wa, 1e-5))
    exact(add_rms_norm(y, res, wb, 1e-6), add_rms_norm(summed, res, wb, 1e-6))
    gw, gb = gate_of(96)
    exact(
        add_rms_norm_hazard(y, res, wb, 1e-6, gw, gb, wa, 1e-5),
        add_rms_norm_hazard(summed, res, wb, 1e-6, gw, gb, wa, 1e-5),
    )
    exact(add_rms_norm_reference(y, res, wb, 1e-6), add_rms_norm_reference(summed, res, wb, 1e-6))


def test_split_sums_order_is_visible():
    """The test data tells the kernels' sum from others: in fp32 summing the splits backwards
    changes bits, in bf16 rounding each partial before the sum does."""
    y = split_sums(5, 96, 4, torch.float32)
    assert not torch.equal(SplitSums(y.parts.flip(0), y.dtype).total(), y.total())
    y = split_sums(5, 96, 4, torch.bfloat16)
    rounded = y.parts.to(torch.bfloat16).float().sum(0).to(torch.bfloat16)
    assert not torch.equal(rounded, y.total())


def test_split_sums_rejects_bad_partials():
    _, res, _, wb = make(3, 48, torch.bfloat16)
    parts = torch.zeros(2, 3, 48)
    with pytest.raises(ValueError, match="split sums must be fp32"):
        add_rms_norm(SplitSums(parts.bfloat16(), torch.bfloat16), res, wb, 1e-6)
    with pytest.raises(ValueError, match="residual must be"):
        add_rms_norm(SplitSums(parts[:, :2], torch.bfloat16), res, wb, 1e-6)
    with pytest.raises(ValueError, match="residual must be"):
        add_rms_norm(SplitSums(parts, torch.float16), res, wb, 1e-6)


# -- GPU -----------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [2048, 3072])
@pytest.mark.parametrize("rows", [1, 8, 64, 300])
def test_gpu_model_shapes_bit_identical(rows, hidden, dtype):
    y, res, wa, wb = make(rows, hidden, dtype, device="cuda", seed=rows)
    exact(add_rms_norm(y, res, wb, 1e-6, wa, 1e-6), unfused(y, res, wb, 1e-6, wa, 1e-6))
    exact(add_rms_norm(y, res, wb, 1e-6), unfused(y, res, wb, 1e-6))


@gpu
@needs_cuda
def test_gpu_cuda_graph():
    y, res, wa, wb = make(8, 2048, torch.bfloat16, device="cuda", seed=7)
    sy, sres = y.clone(), res.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles outside the capture
        add_rms_norm(sy, sres, wb, 1e-6, wa)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = add_rms_norm(sy, sres, wb, 1e-6, wa)
    for seed in (11, 12):
        ny, nres, _, _ = make(8, 2048, torch.bfloat16, device="cuda", seed=seed)
        sy.copy_(ny)
        sres.copy_(nres)
        graph.replay()
        torch.cuda.synchronize()
        exact(out, unfused(ny, nres, wb, 1e-6, wa, 1e-6))


# -- the exit hazard from the same launch (add_rms_norm_hazard) ----------------------------------


def gate_of(hidden: int, device: str = "cpu", seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(1, hidden, generator=gen) * hidden**-0.5
    return w.to(device), torch.randn(1, generator=gen).to(device)


def check_hazard(y, res, wa, wb, gw, gb) -> None:
    """x and h bit for bit the plain chain's; the hazard within a few fp32 ulps of the model's
    torch form (the dot sums in another order: measured <= 2 ulps; a wrong row or a missing
    bias is orders of magnitude off)."""
    x, h, hazard = add_rms_norm_hazard(y, res, wb, 1e-6, gw, gb, y_weight=wa, y_eps=1e-5)
    exact((x, h), add_rms_norm(y, res, wb, 1e-6, y_weight=wa, y_eps=1e-5))
    want = torch.sigmoid(torch.nn.functional.linear(h.float(), gw, gb)).squeeze(-1)
    assert hazard.dtype == torch.float32 and hazard.shape == (y.shape[0],)
    torch.testing.assert_close(hazard, want, atol=1e-6, rtol=4e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 256])
def test_hazard_within_ulps_of_the_torch_gate(dtype, hidden):
    y, res, wa, wb = make(7, hidden, dtype, seed=2)
    check_hazard(y, res, wa, wb, *gate_of(hidden))


def test_hazard_rejects_a_bad_gate():
    y, res, _, wb = make(3, 48, torch.float32)
    gw, gb = gate_of(48)
    with pytest.raises(ValueError, match="the gate must be"):
        add_rms_norm_hazard(y, res, wb, 1e-6, gw[:, :40], gb)
    with pytest.raises(ValueError, match="gate_weight must be fp32"):
        add_rms_norm_hazard(y, res, wb, 1e-6, gw.bfloat16(), gb)
    _, _, empty = add_rms_norm_hazard(y[:0], res[:0], wb, 1e-6, gw, gb)
    assert empty.shape == (0,)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_gpu_split_sums_are_the_gemms_sum_bit_for_bit(rows, splits, dtype):
    y = split_sums(rows, 2048, splits, dtype, device="cuda", seed=rows + splits)
    _, res, wa, wb = make(rows, 2048, dtype, device="cuda", seed=rows)
    summed = y.total()
    exact(add_rms_norm(y, res, wb, 1e-6, wa, 1e-6), add_rms_norm(summed, res, wb, 1e-6, wa, 1e-6))
    exact(add_rms_norm(y, res, wb, 1e-6), add_rms_norm(summed, res, wb, 1e-6))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_gpu_hazard_within_ulps_of_the_torch_gate(rows, dtype):
    y, res, wa, wb = make(rows, 2048, dtype, device="cuda", seed=rows)
    check_hazard(y, res, wa, wb, *gate_of(2048, "cuda"))


# compiled in a process of its own: this one imported triton for the interpreter
_COMPILE = """
from rlt_engine.kernels import norm_chain, paged_attention

norm_chain._import_triton()
fn = paged_attention._kernel(norm_chain._add_rms_norm_kernel, False)
out = {}
for splits, norm_y, gate, early in ((4, True, True, False), (0, False, False, False),
                                   (4, True, False, True)):
    const = dict(H=2048, BLOCK=2048, INV_H=1.0 / 2048, SPLITS=splits, NORM_Y=norm_y, GATE=gate,
                 EXACT_MUL=True, ROUND_BF16=False, PDL=True, EARLY=early, PROBE=early, LINE=64,
                 LINES=32)
    sig = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")}
    sig |= {"eps_y": "fp32", "eps": "fp32", "gw_ptr": "*fp32", "gb_ptr": "*fp32",
            "hazard_ptr": "*fp32", "y_ptr": "*fp32" if splits else "*bf16", "probe_ptr": "*i64"}
    name = f"splits{splits}" + ("_gate" if gate else "") + ("_early_probe" if early else "")
    out[name] = triton_ptx(fn, const, sig, num_warps=8)
print(json.dumps(out))
"""


def test_compiles_for_sm90_with_the_weights_ahead_of_the_pdl_wait():
    """The norms' weights (and the gate's) are loaded before the wait and the residual's lines
    are asked of L2 there; after the wait every load (y or its partials, the residual) is
    issued before the first store: no round trip waits on a reduction (sm_90 PTX)."""
    from sm90_compile import TRITON_PTX, run_compile_script

    for name, code in run_compile_script(TRITON_PTX + _COMPILE).items():
        lines = code.splitlines()
        wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
        release = next(i for i, line in enumerate(lines) if "launch_dependents" in line)
        # EARLY (RELEASE_EARLY_ROWS): the next kernel released before the wait, else after it
        assert (release < wait) == ("early" in name), name
        if "probe" in name:  # the stamps: four %globaltimer reads, four int64 stores
            assert sum("%globaltimer" in line for line in lines) == 4, name
            continue
        loads = [i for i, line in enumerate(lines) if "ld.global" in line]
        first_store = next(i for i, line in enumerate(lines) if "st.global" in line)
        before = sum(i < wait for i in loads)
        assert before == (5 if "gate" in name else 1), name  # w [, wy, gw (2 vectors), gb]
        assert any("prefetch.global.L2" in line for line in lines[:wait]), name
        assert all(i < first_store for i in loads), name
        assert sum(i > wait for i in loads) == (4 * 2 + 1 if "splits4" in name else 2), name
