"""kernels/pdl.py's `Ahead`: the weight slice a decode attention launch asks L2 for on behalf of
the GEMM after the next launch. The slice's arithmetic, and (under the interpreter) that the
launch's programs, in any grid, cover each of its lines exactly once and nothing else; on the
GPU, tests/kernels/test_pdl.py's chain runs it and must give the bits it gives without PDL."""

from __future__ import annotations

import pytest
import torch
from sm90_compile import run_compile_script

pytest.importorskip("triton")

from rlt_engine.kernels import paged_attention as _pa
from rlt_engine.kernels import pdl
from rlt_engine.kernels.small_gemm import l2_ahead


def test_the_slice_starts_past_the_gemms_own_columns_in_whole_lines():
    # Ouro's packed gate/up [11264, 2048] bf16 (64 elements a line), the ws ring's 3 x 128
    # columns fetched by the GEMM itself, 16 MB: 744 columns a row -> 11 whole lines
    assert pdl.ahead_slice(11264, 2048, 2, 384, 16 << 20) == (384, 11, 64)
    # own columns not on a line boundary: the slice starts at the next one
    assert pdl.ahead_slice(11264, 2048, 2, 100, 16 << 20)[0] == 128
    # the budget is bounded by the row's end
    assert pdl.ahead_slice(64, 2048, 2, 1024, 1 << 30) == (1024, 16, 64)
    # fp32: 32 elements a line
    assert pdl.ahead_slice(1024, 4096, 4, 0, 1 << 20) == (0, 8, 32)
    # nothing left: the GEMM fetches the whole row itself, or the budget is under a line a row
    assert pdl.ahead_slice(2048, 512, 2, 512, 16 << 20)[1] == 0
    assert pdl.ahead_slice(11264, 2048, 2, 0, 11264 * 100)[1] == 0


def test_no_slice_without_pdl():
    w = torch.zeros(128, 256, dtype=torch.bfloat16)
    assert not pdl.enabled(w.device)
    assert pdl.ahead(w, 0) is None
    assert l2_ahead(w, 8) is None


def _mark_kernel(marks_ptr, row_stride, col_lo, row_lines, total, LINE: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    """_prefetch_ahead's walk, counting each line it would ask for instead."""
    lo, hi = pdl.ahead_share(total)
    for start in range(lo, hi, BLOCK):
        i = start + tl.arange(0, BLOCK)
        offs = pdl.ahead_offsets(i, row_stride, col_lo, row_lines, LINE)
        tl.atomic_add(marks_ptr + offs // LINE, 1, mask=i < hi)


tl = None  # set by _marks (triton.language), read by the kernel's annotations and body


@pytest.mark.parametrize("grid", [(1, 1, 1), (3, 2, 2), (7, 1, 1), (2, 16, 4)])
@pytest.mark.parametrize("rows,row_lines,col_lo_lines", [(5, 5, 2), (1, 10, 0), (33, 3, 7)])
def test_the_programs_cover_each_line_of_the_slice_once(grid, rows, row_lines, col_lo_lines):
    global tl
    ok, why = _pa.supported(torch.device("cpu"))
    if not ok:
        pytest.skip(why)
    import triton.language

    tl = triton.language
    pdl._import_triton()
    line, row_stride_lines = 4, 12
    marks = torch.zeros(rows * row_stride_lines, dtype=torch.int32)
    kernel = _pa._kernel(_mark_kernel, True)
    kernel[grid](
        marks, row_stride_lines * line, col_lo_lines * line, row_lines, rows * row_lines,
        LINE=line, BLOCK=4,
    )  # fmt: skip
    want = torch.zeros(rows, row_stride_lines, dtype=torch.int32)
    want[:, col_lo_lines : col_lo_lines + row_lines] = 1
    assert torch.equal(marks.view(rows, row_stride_lines), want)


# compiled in a process of its own: this one imported triton for the interpreter
_COMPILE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rlt_engine.kernels import paged_attention as pa

pa._import_triton()
pa._prefetch_helpers()
fn = pa._kernel(pa._paged_attention_kernel, False)
names = fn.arg_names
ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "ahead_ptr")}
ptrs |= {n: "*fp32" for n in ("ws_acc_ptr", "ws_m_ptr", "ws_l_ptr")}
ptrs |= {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr", "count_ptr")}
ptrs["probe_ptr"] = "*i64"
out = {}
for merge in (False, True):
    for ahead in (False, True):
        const = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, GROUP=1, BLOCK_Q=1, BLOCK_M=16,
                     BLOCK_N=64, NUM_SPLITS=4 if merge else 1, PRECISION="tf32", UPCAST=False,
                     PDL=True, PREFETCH_KV=True, ROW_LINES=2, LINE=64, PROBE=False, MERGE=merge,
                     EARLY_META=merge, AHEAD=ahead, AHEAD_LINE=64)
        sig = {n: "i32" for n in names} | {"qk_scale": "fp32"} | ptrs
        sig |= dict.fromkeys(const, "constexpr")
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ptrs}
        src = ASTSource(fn, sig, constexprs={(names.index(c),): v for c, v in const.items()},
                        attrs=attrs)
        options = dict(num_warps=4, num_stages=1 if merge else 2)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        wait = ptx.index("griddepcontrol.wait")
        out[f"merge{merge}_ahead{ahead}"] = [
            ptx[:wait].count("prefetch.global.L2"), ptx.count("prefetch.global.L2"),
            ptx.count("griddepcontrol.wait"),
        ]
print(json.dumps(out))
"""


def test_attention_asks_for_the_slice_before_its_wait_when_compiled_for_sm90():
    """The tensor-core decode kernel, plain and with the split merged in the kernel: with AHEAD
    its extra L2 requests all come before its one PDL wait, and none without it."""
    counts = run_compile_script(_COMPILE)
    for merge in (False, True):
        before, total, waits = counts[f"merge{merge}_aheadTrue"]
        plain_before, plain_total, plain_waits = counts[f"merge{merge}_aheadFalse"]
        assert waits == plain_waits == 1
        assert before == total and plain_before == plain_total  # every request before the wait
        assert total > plain_total, (merge, total, plain_total)
