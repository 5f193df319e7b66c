"""benchmarks/bench_gemm_routes.py: its prototypes stay correct and compilable. The stream-K
kernel runs under the interpreter against a float64 product (uneven shares of units, tiles
split across up to five programs, more programs than N tiles); the persistent chain cannot run
there (spin-waits across programs), so it is compiled for sm_90 and its PTX checked for what
the measurement relies on. (The ws part times kernels/ws_gemm: tests/kernels/test_ws_gemm.py.)"""

from __future__ import annotations

import benchmark_scripts
import pytest
import torch
from sm90_compile import run_compile_script

pytest.importorskip("triton")


def _module():  # type: ignore[no-untyped-def]
    return benchmark_scripts.load("bench_gemm_routes")


@pytest.mark.parametrize(
    ("n", "k", "m", "bn", "bk", "programs"),
    [
        (256, 512, 3, 64, 128, 5),
        (256, 512, 8, 64, 128, 3),
        (128, 1024, 1, 64, 256, 7),
        (256, 512, 16, 64, 128, 13),
    ],
)
def test_streamk_equals_the_product(n, k, m, bn, bk, programs):
    routes = _module()
    gen = torch.Generator().manual_seed(n + m)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    got = routes.streamk(x, w, bn=bn, bk=bk, programs=programs, stages=2)
    want = x.double() @ w.double().T
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)
    again = routes.streamk(x, w, bn=bn, bk=bk, programs=programs, stages=2)
    assert torch.equal(got, again)  # the partials are summed in program order


# compiled in a process of its own: this one imported triton for the interpreter, whose
# @jit helpers cannot be compiled
_COMPILE = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import bench_gemm_routes as routes

def sm90(fn, signature, constexprs, **options):
    names = fn.arg_names
    sig = {name: "i32" for name in names} | signature | dict.fromkeys(constexprs, "constexpr")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a.endswith("_ptr")}
    src = ASTSource(fn, sig, constexprs={(names.index(c),): v for c, v in constexprs.items()},
                 attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

ints = ["tick_o_ptr", "tick_d_ptr", "f_qkv_ptr", "f_act_ptr", "count_ptr"]
bf16 = ["x0_ptr", "x1_ptr", "qkv_ptr", "o_ptr", "act_ptr", "wq_ptr", "wo_ptr", "wgu_ptr", "wd_ptr"]
chain = sm90(
    routes._chain_kernel,
    dict.fromkeys(bf16, "*bf16") | dict.fromkeys(ints, "*i32")
    | {"ws_o_ptr": "*fp32", "ws_d_ptr": "*fp32"},
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SO=4, SD=4, PREFETCH=True, LINE=64),
    num_warps=4, num_stages=4,
)
print(json.dumps({"chain": chain}))
"""


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    return run_compile_script(_COMPILE)


def test_persistent_chain_compiles_with_its_flag_polls_and_tickets(ptx):
    chain = ptx["chain"]
    assert "atom.global.gpu.acquire.add" in chain  # the flags, polled with acquire atomics
    assert "atom.global.gpu.acq_rel.add" in chain  # the split partials' tickets
    assert "mma" in chain and "prefetch.global.L2" in chain
