"""The warp-specialised small-M GEMM (kernels/ws_gemm.py): Gluon, Hopper only.

It cannot run under the interpreter (warp specialisation, TMA, wgmma), so on CPU it is compiled
for sm_90 in a process without TRITON_INTERPRET and its PTX checked for what its exactness and
speed rest on; the dispatch rules are tested directly. On an H200 (-m gpu): Ouro / Nanbeige
shapes within the fp32-accumulation bound of the exact product (kernels/test_small_gemm's
`check`), bitwise deterministic with split-K under contention, counters left zero, graph
replay = eager. Its place in a PDL chain of decode layers: kernels/test_pdl.py."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from decode_forms import decode_forms
from sm90_compile import TRITON_PTX, run_compile_script

pytest.importorskip("triton")

from test_small_gemm import ACC_TOL_GPU, assert_deterministic_under_contention, make
from test_small_gemm import check as check_product

from rlt_engine.kernels import small_gemm
from rlt_engine.kernels.gate_up_swiglu import gate_up_silu
from rlt_engine.kernels.small_gemm import GemmConfig, gemm, lookup
from rlt_engine.kernels.swiglu import silu_mul
from rlt_engine.kernels.ws_gemm import QkvRope, available, check, check_rope

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_ws = pytest.mark.skipif(
    not CUDA or not available(torch.device("cuda")), reason="needs compute capability 9.0"
)


def ws(block_n: int = 64, block_k: int = 128, split_k: int = 1, stages: int = 4) -> GemmConfig:
    return GemmConfig(block_n, block_k, split_k, 4, stages, kernel="ws")


def test_not_available_off_hopper():
    assert not available(torch.device("cpu"))
    x, w = make(4, 64, 128, torch.bfloat16)
    with pytest.raises(RuntimeError, match="does not run on cpu"):
        gemm(x, w, ws())


def test_shape_checks_name_the_constraint():
    assert check(6144, 2048, 16, 64, 256, 1) is None
    assert check(2048, 5632, 8, 64, 128, 4) is None
    assert check(6144, 2048, 64, 64, 256, 1) is None  # the shape (no stages: no shared bound)
    assert "at most 64 rows" in check(6144, 2048, 65, 64, 256, 1)
    assert "multiple of block_n" in check(6100, 2048, 8, 64, 256, 1)
    assert "split_k * block_k = 1024" in check(2048, 5632, 8, 64, 256, 4)
    assert check(11264, 2048, 8, 128, 256, 1, swiglu=True) is None  # 64 gate + 64 up rows
    assert "no split-K" in check(11264, 2048, 8, 128, 128, 4, swiglu=True)
    assert check(11264, 2048, 8, 64, 256, 1, swiglu=True) is None  # halves: 32 + 32 rows
    assert "32, 64 or 128 rows a part" in check(11264, 2048, 8, 32, 256, 1, swiglu=True)
    assert "64 or 128 rows" in check(11264, 2048, 8, 32, 256, 1)
    assert "even N" in check(11265, 2048, 8, 128, 256, 1, swiglu=True)
    x, w = make(65, 64, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="at most 64 rows"):
        gemm(x, w, ws())
    with pytest.raises(ValueError, match="must share a dtype"):
        gemm(x[:4].float(), w.float(), ws())


def test_rows_and_ring_must_fit_a_blocks_shared_memory():
    """A program holds rows_tile(m) rows of its K range beside its ring, or where they do not
    fit (from 32 rows of a long K) a rolling window of max(2, stages) tiles of them; a ring
    too large for either is refused by `check` before anything is compiled."""
    from rlt_engine.kernels.ws_gemm import SHARED_LIMIT, rows_tile, shared_bytes, x_tiles

    assert [rows_tile(m) for m in (1, 8, 9, 16, 17, 32, 33, 64)] == [8, 8, 16, 16, 32, 32, 64, 64]
    # Ouro's qkv at 8 rows, 5 stages of [64, 256] and the RoPE exchange: as the table runs it
    assert shared_bytes(2048, 8, 64, 256, 1, 5, exchange=True) == 2 * (
        5 * 64 * 256 + 8 * 2048 + 64 * 8
    ) + (1 << 10)
    assert x_tiles(2048, 8, 64, 256, 1, 5, exchange=True) == 8  # the whole K range
    assert x_tiles(2048, 32, 64, 256, 1, 2) == 8  # 128 KiB of rows beside 64 of ring
    assert x_tiles(2048, 64, 64, 256, 1, 3) == 3  # 256 KiB of rows: a window of 3 tiles
    assert shared_bytes(2048, 64, 64, 256, 1, 3) == 2 * (3 * 64 * 256 * 2) + (1 << 10)
    assert x_tiles(2048, 64, 64, 256, 2, 2) == 4  # split-K: 128 KiB of rows fit
    assert x_tiles(2048, 64, 128, 128, 1, 1) == 2  # never fewer than two
    assert check(6144, 2048, 64, 64, 256, 1, stages=3) is None
    assert check(11264, 2048, 64, 128, 128, 1, swiglu=True, stages=3) is None
    why = check(6144, 2048, 8, 128, 256, 1, stages=4)  # 256 KiB of ring alone
    assert "beside 4 tiles of 8 rows need 273 KiB of shared memory" in why
    assert "fewer stages" in why
    assert all(shared_bytes(2048, m, 64, 256, 1, 3) <= SHARED_LIMIT for m in (1, 8, 16, 32, 64))


def test_a_ws_row_that_does_not_fit_is_refused_with_the_reason(monkeypatch):
    """A table row whose ring overflows shared memory is refused by the launch (before it is
    compiled); the qkv's RoPE form declines a row whose exchange does not fit beside it (the
    caller's launches run)."""
    from rlt_engine.kernels import ws_gemm as module
    from rlt_engine.kernels.small_gemm import linear_rope

    x, w = make(64, 6144, 2048, torch.bfloat16)
    with pytest.raises(ValueError, match="beside 4 tiles of 8 rows need 273 KiB of shared"):
        gemm(x[:8], w, ws(128, 256, 1, 4))
    calls = []
    monkeypatch.setattr(small_gemm, "choose", lambda x, w, gated=False: ws(64, 256, 2, 2))
    monkeypatch.setattr(small_gemm, "_ws_available", lambda device: True)
    monkeypatch.setattr(module, "ws_gemm", lambda *a, **kw: calls.append(a[0].shape) or "ran")
    pool = torch.zeros(10, 16, 128, dtype=torch.bfloat16)

    def rope_of(rows: int) -> QkvRope:
        trig = torch.zeros(rows, 128, dtype=torch.bfloat16)
        return QkvRope(trig, trig, pool, pool, torch.zeros(rows, dtype=torch.int64), 16)

    assert linear_rope(x, w, rope_of(64)) == "ran"  # 64 rows of 1024: 201 KiB in all
    # a smaller block: the plain GEMM's window of 2 tiles fits (129 KiB), not beside the
    # exchange (137 KiB)
    monkeypatch.setattr(module, "SHARED_LIMIT", 135_000)
    assert linear_rope(x, w, rope_of(64)) is None
    assert linear_rope(x[:8], w, rope_of(8)) == "ran"  # 8 rows: 32 KiB
    assert calls == [(64, 2048), (8, 2048)]


def test_the_ring_bound_applies_from_its_rows_where_it_is_less_than_the_ring():
    """RING_AHEAD_BYTES' tiles in flight from RING_AHEAD_ROWS rows, 0 (the ring) where that
    is every stage: at 8 rows only the qkv's 5-stage ring of 32 KiB tiles is bounded."""
    from rlt_engine.kernels import ws_gemm as module

    assert module.RING_AHEAD_BYTES == 96 * 1024 and module.RING_AHEAD_ROWS == 8
    tile = 64 * 256 * 2  # the qkv's and the o_proj's tiles: 32 KiB
    assert module._ahead(tile, 5, 8) == module._ahead(tile, 5, 16) == 3
    assert module._ahead(tile, 5, 7) == module._ahead(tile, 5, 1) == 0  # below its rows
    assert module._ahead(tile, 3, 8) == module._ahead(tile, 2, 8) == 0  # the whole ring
    assert module._ahead(2 * 64 * 128 * 2, 3, 8) == 0  # the gate/up's 3 stages at 8 rows
    assert module._ahead(100 * 1024, 4, 8) == 1  # never less than one tile


def test_two_programs_an_sm_only_past_one_wave_and_within_half_its_shared(monkeypatch):
    """TWO_PER_SM launches a GEMM (any form) at half the register file where it has more
    programs than SMs and a program fits half an SM's shared memory; the rows then take a
    window where the whole K range does not fit beside the ring in half."""
    from rlt_engine.kernels import ws_gemm as module

    half = module.HALF_SM_SHARED
    assert 2 * (half + (1 << 10)) <= 228 << 10  # two blocks and their reserved KiB an SM
    nanbeige = ws(128, 64, 1, 3)  # Nanbeige's gate/up [21504, 3072]: 168 programs
    monkeypatch.setattr(module, "TWO_PER_SM", False)
    assert not module.two_per_sm(168, 132, 3072, 8, nanbeige)
    monkeypatch.setattr(module, "TWO_PER_SM", True)
    for m in (1, 8, 16):
        assert module.two_per_sm(168, 132, 3072, m, nanbeige)
    # 8 rows: the whole K range (48 KiB) beside the 48 KiB ring, 97 KiB
    assert module.shared_bytes(3072, 8, 128, 64, 1, 3, limit=half) == 2 * (
        3 * 128 * 64 + 48 * 8 * 64
    ) + (1 << 10)
    # 16 rows: 96 KiB of rows fit beside the ring in a whole SM, in half a window of 3 tiles
    assert module.x_tiles(3072, 16, 128, 64, 1, 3) == 48
    assert module.x_tiles(3072, 16, 128, 64, 1, 3, limit=half) == 3
    assert not module.two_per_sm(132, 132, 3072, 8, nanbeige)  # one wave already
    assert not module.two_per_sm(168, 132, 3072, 8, ws(128, 128, 1, 4))  # 128 KiB ring
    # the table's rows for it: 128x128 tiles, 2 stages (the rows whole) or 3 (a window)
    assert module.two_per_sm(168, 132, 3072, 1, ws(128, 128, 1, 2))
    assert module.x_tiles(3072, 8, 128, 128, 1, 2, limit=half) == 24
    assert module.x_tiles(3072, 8, 128, 128, 1, 3, limit=half) == 3
    assert module.two_per_sm(168, 132, 3072, 16, ws(128, 128, 1, 3))
    # other forms past one wave: Ouro's qkv split 2 ways (192 programs) with its RoPE
    # exchange, its o_proj 8 ways (256); not its 5-stage qkv ring of 32 KiB tiles
    assert module.two_per_sm(192, 132, 2048, 8, ws(64, 128, 2, 4), exchange=True)
    assert module.two_per_sm(256, 132, 2048, 8, ws(64, 128, 8, 2))
    assert not module.two_per_sm(192, 132, 2048, 8, ws(64, 256, 2, 5), exchange=True)


def test_the_launch_takes_half_the_registers_and_a_window_only_where_two_share_an_sm(monkeypatch):
    """The launch's wiring of `two_per_sm` (the kernel replaced by a recorder, on the CPU):
    maxnreg TWO_PER_SM_REGISTERS and the x rows within HALF_SM_SHARED for Nanbeige's gate/up
    (168 programs) and a plain GEMM split past one wave, the whole register file and a whole
    SM's shared memory for Ouro's gate/up in 128-row tiles (88) and the plain GEMM's 96."""
    from rlt_engine.kernels import ws_gemm as module

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, kwargs))

    monkeypatch.setattr(module, "_kernel", Recorder)
    monkeypatch.setattr(module, "available", lambda device: True)
    monkeypatch.setattr(module, "_sms", lambda device: 132)
    x = torch.zeros(8, 3072, dtype=torch.bfloat16)
    config = ws(128, 128, 1, 3)
    module.ws_gemm(x, torch.zeros(21504, 3072, dtype=torch.bfloat16), config, swiglu=True)
    grid, launch = launches.pop()
    assert grid == (168, 1) and launch["maxnreg"] == module.TWO_PER_SM_REGISTERS
    assert (launch["XT"], launch["KT"]) == (3, 24)  # a window: 24 tiles do not fit in half
    module.ws_gemm(x[:, :2048], torch.zeros(11264, 2048, dtype=torch.bfloat16), config, True)
    grid, launch = launches.pop()
    assert grid == (88, 1) and "maxnreg" not in launch and launch["XT"] == launch["KT"] == 16
    # `halves`: 32 gate + 32 up rows a program, one 64-row MMA: 176 programs, two an SM
    module.ws_gemm(
        x[:, :2048], torch.zeros(11264, 2048, dtype=torch.bfloat16), ws(64, 128, 1, 4), True
    )
    grid, launch = launches.pop()
    assert grid == (176, 1) and launch["maxnreg"] == module.TWO_PER_SM_REGISTERS
    assert launch["HALVES"] and (launch["PARTS"], launch["BN"]) == (1, 64)
    assert launch["XT"] == launch["KT"] == 16  # 8 rows of K = 2048 fit beside a 64 KiB ring
    qkv = torch.zeros(6144, 2048, dtype=torch.bfloat16)
    module.ws_gemm(x[:, :2048], qkv, ws(64, 256, 1, 5))
    grid, launch = launches.pop()
    assert grid == (96, 1) and "maxnreg" not in launch
    module.ws_gemm(x[:, :2048], qkv, ws(64, 128, 2, 4))
    grid, launch = launches.pop()
    assert grid == (96, 2) and launch["maxnreg"] == module.TWO_PER_SM_REGISTERS
    monkeypatch.setattr(module, "TWO_PER_SM", False)
    module.ws_gemm(x, torch.zeros(21504, 3072, dtype=torch.bfloat16), config, swiglu=True)
    grid, launch = launches.pop()
    assert "maxnreg" not in launch and launch["XT"] == launch["KT"] == 24


def test_gate_up_silu_takes_a_ws_row_where_the_kernel_runs(monkeypatch):
    """A "ws" row for the packed gate/up runs the SwiGLU form; where the kernel cannot run
    (here: CPU) or take the config, the caller's two launches do."""
    from rlt_engine.kernels import ws_gemm

    x, w = make(8, 256, 128, torch.bfloat16)
    calls = []
    monkeypatch.setattr(small_gemm, "choose", lambda x, w, gated=False: ws(128, 64, 1, 2))
    assert gate_up_silu(x, w) is None  # not available on CPU
    monkeypatch.setattr(ws_gemm, "available", lambda device: True)
    monkeypatch.setattr(ws_gemm, "ws_gemm", lambda *a, **kw: calls.append(kw) or "ran")
    assert gate_up_silu(x, w) == "ran" and calls == [{"swiglu": True}]
    monkeypatch.setattr(small_gemm, "choose", lambda x, w, gated=False: ws(64, 64, 1, 2))
    assert gate_up_silu(x, w) == "ran"  # 32 rows a part: `halves`, one MMA tile
    monkeypatch.setattr(small_gemm, "choose", lambda x, w, gated=False: ws(32, 64, 1, 2))
    assert gate_up_silu(x, w) is None  # 16 rows a part: the SwiGLU form cannot take it
    monkeypatch.setattr(small_gemm, "choose", lambda x, w, gated=False: ws(128, 64, 2, 2))
    assert gate_up_silu(x, w) is None  # nor split-K


def test_rope_checks_name_the_constraint():
    rows, d = 3, 32
    x = torch.zeros(rows, 64)
    pool = torch.zeros(10, 2, d)
    trig = torch.zeros(rows, d)
    slots = torch.zeros(rows, dtype=torch.int64)
    rope = QkvRope(trig, trig, pool, pool, slots, num_heads=4)
    assert check_rope(8 * d, 16, rope, x) is None  # (4 + 2 * 2) heads of 32
    assert "heads + 2 kv_heads" in check_rope(9 * d, 16, rope, x)
    assert "multiple of block_n" in check_rope(8 * d, 64, rope, x)  # a tile spans two heads
    assert "multiple of block_n" in check_rope(8 * d, 8, rope, x)  # half boxes under 8 rows
    assert "contiguous" in check_rope(8 * d, 16, rope._replace(v_pool=pool.transpose(0, 1)), x)
    assert "must be torch.float32" in check_rope(8 * d, 16, rope._replace(cos=trig.half()), x)
    assert "[3, 32]" in check_rope(8 * d, 16, rope._replace(sin=trig[:2]), x)
    assert "int64" in check_rope(8 * d, 16, rope._replace(slot_mapping=slots.int()), x)


def test_linear_rope_declines_where_no_ws_kernel_runs():
    """Off the GPU (or where the table has no ws row) the caller keeps its own launches."""
    from rlt_engine.kernels.small_gemm import linear_rope

    x, w = torch.zeros(2, 64), torch.zeros(8 * 8, 64)
    pool, trig = torch.zeros(10, 2, 8), torch.zeros(2, 8)
    rope = QkvRope(trig, trig, pool, pool, torch.zeros(2, dtype=torch.int64), num_heads=4)
    assert linear_rope(x, w, rope) is None


def test_table_rows_name_the_kernel():
    """A "ws" row gives the warp-specialised config (also gated: the fastest kernel)."""
    entries = {
        "64x128:m8:bfloat16": ("ws", 64, 128, 1, 4, 4, 4.0, 5.0),
        "64x128:m16:bfloat16": ("cublas", 64, 128, 2, 4, 3, 5.1, 5.0),
    }
    assert lookup(entries, 64, 128, 5, torch.bfloat16) == ws()
    assert lookup(entries, 64, 128, 5, torch.bfloat16, gated=True) == ws()
    assert lookup(entries, 64, 128, 12, torch.bfloat16) is None
    assert lookup(entries, 64, 128, 12, torch.bfloat16, gated=True) == GemmConfig(64, 128, 2, 4, 3)


# compiled in a process of its own: this one imported triton for the interpreter
_COMPILE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from rlt_engine.kernels import ws_gemm

fn = ws_gemm._build()
names = fn.arg_names
out = {}
configs = ((8, 64, 256, 3, 1, 1, "bf16", False, 0, False),
           (16, 64, 128, 4, 4, 1, "fp16", False, 0, False),
           (8, 64, 128, 3, 1, 2, "bf16", False, 0, False),
           (8, 64, 256, 2, 4, 1, "bf16", True, 0, False),
           (8, 64, 128, 4, 1, 1, "bf16", True, 0, False),
           (8, 64, 256, 5, 1, 1, "bf16", False, 128, False),
           (16, 128, 256, 2, 2, 1, "bf16", False, 128, False),
           (8, 64, 256, 2, 4, 1, "bf16", False, 0, True),
           (8, 64, 256, 5, 1, 1, "bf16", False, 128, False, True, 0),
           (8, 64, 256, 5, 1, 1, "bf16", False, 128, False, True, 3),
           (32, 64, 128, 2, 1, 2, "bf16", False, 0, False),
           (64, 64, 256, 2, 2, 1, "bf16", False, 128, False),
           (64, 64, 128, 4, 4, 1, "bf16", False, 0, True),
           (64, 64, 128, 3, 1, 2, "bf16", False, 0, False),
           (64, 64, 256, 3, 1, 1, "bf16", False, 128, False),
           # two programs an SM (ws_gemm.two_per_sm), as the table runs Nanbeige's gate/up at
           # 16 rows: a window of x tiles within half an SM's shared memory; and `halves`
           # (parts "h": 32 gate + 32 up rows in one MMA) as the table runs Ouro's gate/up
           # at 1-8 rows (6 stages, so a window of x tiles too)
           (16, 64, 128, 3, 1, 2, "bf16", False, 0, False, False, 0, 128),
           (8, 64, 128, 6, 1, "h", "bf16", False, 0, False, False, 0, 128),
           # and the other forms past one wave, as the tuner may run them: Ouro's qkv split
           # 2 ways with the RoPE epilogue (its ticket; rows by cp.async, or a window of x
           # tiles), its o_proj 8 ways unreduced
           (8, 64, 128, 4, 2, 1, "bf16", False, 128, False, True, 0, 128),
           (8, 64, 256, 3, 2, 1, "bf16", False, 128, False, False, 0, 128),
           (8, 64, 128, 2, 8, 1, "bf16", False, 0, True, True, 0, 128))
shared, inits, usage = {}, {}, {}
# the rows by TMA and every tile in flight, unless a config names XLOAD and AHEAD; the whole
# register file unless it names a maxnreg (ws_gemm.two_per_sm's launch)
for bm, bn, bk, stages, split, parts, dt, probe, rope, unreduced, *more in configs:
    xload, ahead, *regs = more or (False, 0)
    halves, parts = parts == "h", 2 if parts == 2 else 1
    exchange = rope > 0 or halves
    g = gl.bfloat16 if dt == "bf16" else gl.float16
    desc = lambda rows: (
        f"tensordesc<{dt}[{rows}, {bk}],"
        f"{gl.NVMMASharedLayout.get_default_for([rows, bk], g)!r}>"
    )
    kt = 2048 // (split * bk)
    limit = ws_gemm.HALF_SM_SHARED if regs else ws_gemm.SHARED_LIMIT
    xt = ws_gemm.x_tiles(2048, bm, bn * parts, bk, split, stages, exchange, limit)
    const = dict(KT=kt, XT=xt, BM=bm, BN=bn, BK=bk, STAGES=stages, SPLIT=split,
                 PARTS=parts, HALVES=halves, PDL=True, PROBE=probe, ROPE=rope > 0, D=rope or 1,
                 LATE=rope > 0, UNREDUCED=unreduced, XLOAD=xload, AHEAD=ahead)
    sig = {n: "i32" for n in names} | dict.fromkeys(const, "constexpr") | {
        "x_ptr": f"*{dt}",
        "x_desc": desc(bm), "w_desc": desc(bn // 2 if halves else bn), "out_ptr": f"*{dt}",
        "part_ptr": "*fp32",
        "tick_ptr": "*i32", "probe_ptr": "*i64", "cos_ptr": f"*{dt}", "sin_ptr": f"*{dt}",
        "kpool_ptr": f"*{dt}", "vpool_ptr": f"*{dt}", "slot_ptr": "*i64"}
    aligned = [a for a in names if a.endswith("_ptr") or a == "K"]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(fn, sig, constexprs={(names.index(c),): v for c, v in const.items()},
                         attrs=attrs)
    options = dict(num_warps=4) | ({"maxnreg": regs[0]} if regs else {})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    name = f"split{split}" + ("_swiglu" if parts == 2 else "") + ("_halves" if halves else "")
    name += "_probe" if probe else ""
    name += f"_rope_bn{bn}" if rope else ""
    name += "_unreduced" if unreduced else ""
    name += "_xload" if xload else ""
    name += f"_ahead{ahead}" if ahead else ""
    name += f"_m{bm}" if bm > 16 else ""
    name += f"_regs{regs[0]}" if regs else ""
    out[name] = kernel.asm["ptx"]
    estimate = ws_gemm.shared_bytes(2048, bm, bn * parts, bk, split, stages, exchange, limit)
    shared[name] = [kernel.metadata.shared, estimate]
    inits[name] = [kernel.asm["ptx"].count("mbarrier.init"), 2 * stages + (xt if xt < kt else 1),
                   xt < kt]
    if regs:  # [registers a thread, spill bytes] as ptxas builds it
        usage[name] = ptxas_usage(kernel.asm["ptx"])
print(json.dumps({"ptx": out, "shared": shared, "inits": inits, "usage": usage}))
"""


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    return run_compile_script(TRITON_PTX + _COMPILE)


@pytest.fixture(scope="module")
def ptx(compiled) -> dict[str, str]:
    return compiled["ptx"]


def test_shared_bytes_is_what_the_compiler_allocates(compiled):
    """`shared_bytes` (which `check` bounds by SHARED_LIMIT before anything is compiled) is
    the compiled kernel's shared memory and SHARED_SLACK's barriers, for rows of 8 to 64."""
    from rlt_engine.kernels.ws_gemm import SHARED_SLACK

    assert {"split1_swiglu_m32", "split2_rope_bn64_m64", "split4_unreduced_m64"} <= set(
        compiled["shared"]
    )
    for name, (allocated, estimate) in compiled["shared"].items():
        assert estimate - SHARED_SLACK < allocated <= estimate, name


def test_two_programs_an_sm_fit_half_its_registers_and_shared_memory_without_spills(compiled):
    """The 128-register builds (ws_gemm.two_per_sm) as ptxas makes them: at most
    TWO_PER_SM_REGISTERS a thread, no spill stores (a spill would put local-memory traffic in
    the weight stream), and shared memory within HALF_SM_SHARED; so two programs share an SM."""
    from rlt_engine.kernels.ws_gemm import HALF_SM_SHARED, TWO_PER_SM_REGISTERS

    assert set(compiled["usage"]) == {
        "split1_swiglu_regs128",
        "split1_halves_regs128",
        "split2_rope_bn64_xload_regs128",
        "split2_rope_bn64_regs128",
        "split8_unreduced_xload_regs128",
    }
    for name, (registers, spilled) in compiled["usage"].items():
        assert registers <= TWO_PER_SM_REGISTERS and spilled == 0, (name, registers, spilled)
        assert compiled["shared"][name][0] <= HALF_SM_SHARED, name


def test_a_barrier_per_ring_stage_and_one_for_the_whole_rows_or_one_per_window_tile(compiled):
    """The whole-range path (all rows of 1-16) keeps its one barrier: e9cf507 gave it one per
    x tile (each init followed by a block-wide sync, in the prologue decode waits for, and
    the tile's index taken modulo the window), and c=8 ran 1.4% slower
    (results/2026-12-06-nanbeige-m32-h100.md)."""
    assert any(windowed for *_, windowed in compiled["inits"].values())
    for name, (inits, want, _) in compiled["inits"].items():
        assert inits == want, name


def test_compiles_for_sm90_with_the_weight_stream_ahead_of_the_pdl_wait(ptx):
    for name, code in ptx.items():
        assert "wgmma.mma_async" in code, name  # both operands from shared memory
        assert "cp.async.bulk.tensor" in code and "mbarrier.try_wait" in code, name  # the ring
        assert "setmaxnreg" in code, name  # two partitions: the producer warp and the MMA warps
        # the whole register file (see the launch), or half of it for two programs an SM
        assert f".maxnreg {128 if name.endswith('_regs128') else 256}" in code, name
        # one wait, in the consumer partition only: the producer's copies never wait for it
        assert code.count("griddepcontrol.wait") == 1, name
        assert code.count("griddepcontrol.launch_dependents") == 1, name
    assert "atom.global.gpu.acq_rel.add" in ptx["split4"]  # the partials' tickets
    assert "atom.global" not in ptx["split1"]
    # unreduced partials (kernels/split_sums): stored, no ticket, no reload of the others'
    assert (
        "atom.global" not in ptx["split4_unreduced"]
        and "ld.global.cg" not in (ptx["split4_unreduced"])
    )
    assert "ld.global.cg" in ptx["split4"]
    # the qkv epilogue: rope.py's products (mul.rn, never an FMA); a program holds whole RoPE
    # pairs (two half boxes a stage): no ticket but split-K's
    assert "mul.rn.f32" in ptx["split1_rope_bn64"] and "mul.rn.f32" not in ptx["split1"]
    assert "atom.global" not in ptx["split1_rope_bn64"]
    assert ptx["split2_rope_bn128"].count("atom.global.gpu.acq_rel.add") == 1
    # its cos / sin and slots are loaded before the MMA loop (their round trip overlaps it):
    # without split-K no load follows the first MMA
    rope = ptx["split1_rope_bn64"].splitlines()
    first_mma = next(i for i, line in enumerate(rope) if "wgmma.mma_async" in line)
    assert any("ld.global" in line for line in rope[:first_mma])
    assert not any("ld.global" in line for line in rope[first_mma:])
    swiglu = ptx["split1_swiglu"]  # silu with an IEEE division, no tickets
    assert "div.rn.f32" in swiglu and "ex2.approx" in swiglu and "atom.global" not in swiglu
    # `halves`: one MMA a stage where the two-part form has two, two copies (half boxes) a
    # stage, and the halves exchanged in shared memory before the same activation
    pair = ptx["split1_halves_regs128"]
    assert pair.count("wgmma.mma_async") * 2 == ptx["split1_swiglu_regs128"].count(
        "wgmma.mma_async"
    )
    assert "div.rn.f32" in pair and "atom.global" not in pair and "ld.shared" in pair
    assert "div.rn.f32" not in ptx["split1"] and "div.rn.f32" not in ptx["split4"]
    # up to X_BY_LOADS_ROWS rows the consumers copy the rows by cp.async, after the PDL wait
    # (they are the kernel before's output); TMA builds copy none that way
    xload = ptx["split1_rope_bn64_xload_ahead3"].splitlines()
    wait = next(i for i, line in enumerate(xload) if "griddepcontrol.wait" in line)
    rows = [i for i, line in enumerate(xload) if "cp.async.cg.shared.global" in line]
    assert rows and min(rows) > wait
    assert "cp.async.wait_group" in ptx["split1_rope_bn64_xload_ahead3"]
    assert "cp.async.cg.shared" not in ptx["split1_rope_bn64"]
    # the bounded ring: the producer also waits for the tile AHEAD before the one it issues
    names = ("split1_rope_bn64_xload", "split1_rope_bn64_xload_ahead3")
    assert [ptx[n].count("mbarrier.try_wait") for n in names] == [2, 3]  # (ring: full, empty)
    # PROBE builds read the global timer; the others never do
    for name, code in ptx.items():
        assert ("%globaltimer" in code) == name.endswith("_probe"), name


# -- GPU -----------------------------------------------------------------------------------------

SHAPES = {  # (N, K) -> configs the table may choose (the last ones fit 64 rows)
    "ouro_qkv": (
        (6144, 2048),
        [ws(64, 256, 1, 3), ws(64, 128, 1, 4), ws(128, 128, 2, 3), ws(64, 256, 2, 2)],
    ),
    "ouro_o": ((2048, 2048), [ws(64, 128, 4, 4), ws(64, 256, 2, 3), ws(64, 256, 4, 2)]),
    "ouro_down": ((2048, 5632), [ws(64, 128, 4, 4), ws(64, 128, 2, 4), ws(64, 128, 4, 2)]),
    "nanbeige_down": (
        (3072, 10752),
        # the first as the table runs it at 1-16 rows
        [ws(64, 256, 2, 5), ws(64, 128, 4, 3), ws(64, 128, 6, 2), ws(64, 128, 12, 2)],
    ),
}
ROWS = [1, 5, 8, 16, 24, 32, 48, 64]  # every rows_tile, full and partly filled


def fitting(n: int, k: int, m: int, configs, swiglu: bool = False, rope: bool = False):
    """The configs whose ring and rows fit a block's shared memory at m rows (at least one)."""
    from rlt_engine.kernels.ws_gemm import SHARED_LIMIT, halves, shared_bytes

    fit = [
        c for c in configs
        if check(n, k, m, c.block_n, c.block_k, c.split_k, swiglu, c.num_stages) is None
        and shared_bytes(k, m, c.block_n, c.block_k, c.split_k, c.num_stages,
                         rope or halves(swiglu, c.block_n)) <= SHARED_LIMIT
    ]  # fmt: skip
    assert fit, (n, k, m)
    return fit


@gpu
@needs_ws
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("m", ROWS)
def test_gpu_model_shapes_within_the_product_bound(name, m):
    (n, k), configs = SHAPES[name]
    x, w = make(m, n, k, torch.bfloat16, device="cuda", seed=m)
    for config in fitting(n, k, m, configs):
        out = gemm(x, w, config)
        check_product(out, x, w, ACC_TOL_GPU)
        assert torch.equal(gemm(x, w, config), out)
    assert int(small_gemm._counters(x.device).abs().sum()) == 0


@gpu
@needs_ws
def test_gpu_fp16_lead_dims_and_views():
    x, w = make(6, 2048, 2048, torch.float16, device="cuda", seed=3)
    out = gemm(x.view(2, 3, 2048), w, ws(64, 128, 4))
    assert out.shape == (2, 3, 2048)
    check_product(out.view(6, 2048), x, w, ACC_TOL_GPU)
    wide = torch.cat([x, x], dim=1)[:, :2048]  # a strided view: copied, same result
    assert torch.equal(gemm(wide, w, ws(64, 128, 4)), out.view(6, 2048))


@gpu
@needs_ws
def test_gpu_split_k_deterministic_under_contention():
    assert_deterministic_under_contention((ws(64, 128, 4), ws(64, 128, 11, 2)))


@gpu
@needs_ws
def test_gpu_cuda_graph_equals_eager():
    """A chain (each GEMM reads the one before: the PDL wait is what orders them)."""
    (n, k), _ = SHAPES["ouro_o"]
    weights = [make(1, n, k, torch.bfloat16, device="cuda", seed=i)[1] * 0.1 for i in range(4)]
    x = make(8, n, k, torch.bfloat16, device="cuda", seed=9)[0]
    configs = [ws(64, 128, 4), ws(64, 256, 1, 3), ws(64, 128, 2), ws(128, 128, 1, 3)]

    def chain() -> torch.Tensor:
        h = x
        for w, config in zip(weights, configs, strict=True):
            h = gemm(h, w, config)
        return h

    eager = chain()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@gpu
@needs_ws
def test_gpu_keeps_no_reference_to_its_operands():
    """Nothing of a launch outlives it: a dropped weight's memory is freed (a descriptor kept
    in a cache would hold the tensor, and with it a dropped engine's weights)."""
    x, w = make(8, 2048, 2048, torch.bfloat16, device="cuda", seed=5)
    for config in (ws(64, 128, 4), ws(64, 256, 1, 3)):
        gemm(x, w, config)
    refs = [weakref.ref(w), weakref.ref(x)]
    del x, w
    gc.collect()
    assert all(ref() is None for ref in refs)


@gpu
@needs_ws
@pytest.mark.parametrize(
    ("m", "inter", "hidden"),
    [(m, 5632, 2048) for m in (1, 8, 16, 24, 32, 48, 64)]
    + [(m, 64 * 12, 3072) for m in (1, 8, 16, 64)],
)
def test_gpu_swiglu_form_within_the_bound_of_its_gemm_then_silu_mul(m, inter, hidden):
    """The SwiGLU form within an ulp of the unfused path on the same kernel (its GEMM, then
    silu_mul): the same accumulations, so only the activation's last rounding may differ;
    deterministic. (No split-K: from 48 rows of K = 2048 a window of the rows, `x_tiles`.)"""
    x, w = make(m, 2 * inter, hidden, torch.bfloat16, device="cuda", seed=m)
    # ws(64, ...): `halves` (32 gate + 32 up rows in one MMA; 6 stages: the table's rows of
    # Ouro's gate/up at 1-8 rows); its GEMM's tiles are 64 rows
    tiles = [
        ws(128, 128, 1, 3),
        ws(128, 256, 1, 2),
        ws(256, 64, 1, 3),
        ws(64, 128, 1, 4),
        ws(64, 128, 1, 6),
    ]
    for config in fitting(2 * inter, hidden, m, tiles, swiglu=True):
        block_n, block_k, stages = config.block_n, config.block_k, config.num_stages
        fused = gate_up_silu(x, w, config)
        plain = silu_mul(gemm(x, w, ws(max(64, block_n // 2), block_k, 1, stages)))
        torch.testing.assert_close(fused, plain, rtol=2**-7, atol=1e-6)
        assert torch.equal(gate_up_silu(x, w, config), fused)


@gpu
@needs_ws
@pytest.mark.parametrize("m", [1, 4, 8, 16])
def test_gpu_rows_by_loads_and_a_bounded_ring_give_the_same_bits(m, monkeypatch):
    """The rows copied by cp.async instead of TMA and the weight tiles in flight bounded only
    schedule the same copies and MMAs otherwise: the same bits at any row count (qkv, o_proj,
    down_proj, the SwiGLU form)."""
    from rlt_engine.kernels import ws_gemm as module

    cases = (
        ((6144, 2048), ws(64, 256, 1, 5), False),
        ((2048, 2048), ws(64, 256, 4, 2), False),  # the whole K range in the ring
        ((2048, 5632), ws(64, 128, 4, 4), False),
        ((11264, 2048), ws(128, 256, 1, 2), True),
    )

    def run(x, w, config, swiglu: bool, rows: int, ahead: int) -> torch.Tensor:
        monkeypatch.setattr(module, "X_BY_LOADS_ROWS", rows)
        monkeypatch.setattr(module, "RING_AHEAD_BYTES", ahead)
        monkeypatch.setattr(module, "RING_AHEAD_ROWS", 1)
        return gate_up_silu(x, w, config) if swiglu else gemm(x, w, config)

    for (n, k), config, swiglu in cases:
        x, w = make(m, n, k, torch.bfloat16, device="cuda", seed=m)
        plain = run(x, w, config, swiglu, 0, 0)
        assert torch.equal(run(x, w, config, swiglu, 16, 0), plain)
        assert torch.equal(run(x, w, config, swiglu, 0, 16 * 1024), plain)  # one tile ahead
        assert torch.equal(run(x, w, config, swiglu, 16, 32 * 1024), plain)
    assert int(small_gemm._counters(x.device).abs().sum()) == 0


@gpu
@needs_ws
@pytest.mark.parametrize(
    ("m", "config"),
    [
        (m, c)
        for m in (1, 8, 16)
        for c in (ws(128, 64, 1, 3), ws(128, 128, 1, 2), ws(128, 128, 1, 3))
    ]
    + [(32, ws(128, 64, 1, 3)), (32, ws(128, 128, 1, 2))],  # the table's m32 row: the second
)
def test_gpu_two_swiglu_programs_an_sm_give_the_same_bits(m, config, monkeypatch):
    """TWO_PER_SM changes the launch (half the registers; from 16 rows a window of x tiles),
    not the arithmetic: Nanbeige's gate/up gives the whole-register launch's bits."""
    from rlt_engine.kernels import ws_gemm as module

    x, w = make(m, 21504, 3072, torch.bfloat16, device="cuda", seed=m)
    monkeypatch.setattr(module, "TWO_PER_SM", False)
    whole = gate_up_silu(x, w, config)
    monkeypatch.setattr(module, "TWO_PER_SM", True)
    assert module.two_per_sm(168, module._sms(x.device), 3072, m, config)
    assert torch.equal(gate_up_silu(x, w, config), whole)


ROPE_CASES = [
    (16, 16, 2048, ws(64, 256, 1, 5)),  # Ouro's qkv as its table runs it: 2 tiles a head
    (16, 16, 2048, ws(64, 256, 2, 3)),  # split-K: the last split stores, then the ticket
    (16, 16, 2048, ws(128, 256, 2, 2)),  # a tile is a head: no ticket
    (16, 16, 2048, ws(64, 256, 2, 2)),  # 32-64 rows: split-K to fit the rows
    (48, 8, 3072, ws(64, 256, 1, 5)),  # Nanbeige (GQA) as its table runs it at 1-16 rows
    (48, 8, 3072, ws(64, 256, 1, 4)),
    (48, 8, 3072, ws(64, 256, 4, 2)),
    (16, 16, 2048, ws(64, 128, 1, 8)),  # both qkv rows the table runs at 17-32 rows (windowed)
    (48, 8, 3072, ws(64, 128, 1, 8)),
]


@gpu
@needs_ws
@pytest.mark.parametrize("m", [1, 8, 16])
def test_gpu_two_programs_an_sm_give_the_same_bits_in_every_form(m, monkeypatch):
    """TWO_PER_SM in the forms past one wave other than SwiGLU's: Ouro's qkv split 2 ways (192
    programs, the last split's ticket) plain and with the RoPE epilogue, its o_proj's 8
    unreduced partials (256 programs): the bits of the same launches one program an SM (two
    waves), every ticket counter back at zero. (dc7a1eb's split-K SwiGLU at two an SM gave
    launch-to-launch differences: this isolates the ticket at two an SM.)"""
    from rlt_engine.kernels import ws_gemm as module

    split_qkv, split_o = ws(64, 128, 2, 4), ws(64, 128, 8, 2)
    x, w_qkv = make(m, 6144, 2048, torch.bfloat16, device="cuda", seed=m)
    w_o = make(1, 2048, 2048, torch.bfloat16, device="cuda", seed=m + 1)[1]
    d, slots = 128, 64
    g = torch.Generator(device="cuda").manual_seed(m)
    angles = torch.rand(m, d, device="cuda", generator=g) * 6.28
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    slot_mapping = torch.randperm(slots, device="cuda", generator=g)[:m]
    assert module.two_per_sm(192, module._sms(x.device), 2048, m, split_qkv, exchange=True)
    assert module.two_per_sm(256, module._sms(x.device), 2048, m, split_o)

    def run(two: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(module, "TWO_PER_SM", two)
        pools = [torch.zeros(slots, 16, d, dtype=torch.bfloat16, device="cuda") for _ in "kv"]
        plain = module.ws_gemm(x, w_qkv, split_qkv)
        rope = QkvRope(cos, sin, *pools, slot_mapping, 16)
        roped = module.ws_gemm(x, w_qkv, split_qkv, rope=rope)
        parts = module.ws_gemm(x, w_o, split_o, unreduced=True).parts
        return [plain, roped, *pools, parts]

    one = run(False)
    for _ in range(2):
        for a, b in zip(run(True), one, strict=True):
            assert torch.equal(a, b)
    assert int(small_gemm._counters(x.device).abs().sum()) == 0


def _rope_fits(m: int, hidden: int, config: GemmConfig) -> bool:
    from rlt_engine.kernels.ws_gemm import SHARED_LIMIT, shared_bytes

    c = config
    return shared_bytes(hidden, m, c.block_n, c.block_k, c.split_k, c.num_stages, True) <= (
        SHARED_LIMIT
    )


@gpu
@needs_ws
@pytest.mark.parametrize(
    ("m", "heads", "kv_heads", "hidden", "config"),
    [(m, *case) for m in ROWS for case in ROPE_CASES if _rope_fits(m, case[2], case[3])],
)
def test_gpu_qkv_rope_epilogue_equals_rope_write_kv(m, heads, kv_heads, hidden, config):
    """The GEMM with RoPE + the K/V write in its epilogue = the GEMM, then rope_write_kv_:
    the same bits in the returned q / k / v and in both pools, counters left zero; idle rows
    share the trash slot; twice in a row."""
    from rlt_engine.kernels.rope_kv_write import rope_write_kv_
    from rlt_engine.kernels.ws_gemm import ws_gemm

    d, slots = 128, 128  # more slots than rows (64 at most) and the trash slot
    n = (heads + 2 * kv_heads) * d
    x, w = make(m, n, hidden, torch.bfloat16, device="cuda", seed=m + heads)
    g = torch.Generator(device="cuda").manual_seed(m)
    angles = torch.rand(m, d, device="cuda", generator=g) * 6.28
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    slot_mapping = torch.randperm(slots - 1, device="cuda", generator=g)[:m]
    slot_mapping[m // 2 :] = slots - 1  # idle rows: the trash slot (raced, never compared)
    fill = torch.randn(slots, kv_heads, d, device="cuda", generator=g).bfloat16()
    pools = [fill.clone() for _ in range(4)]
    plain = ws_gemm(x, w, config)
    q, k, v = plain.view(m, -1, d).split([heads, kv_heads, kv_heads], dim=1)
    rope_write_kv_(q, k, v, cos, sin, pools[0], pools[1], slot_mapping)
    for _ in range(2):
        fused = ws_gemm(x, w, config, rope=QkvRope(cos, sin, *pools[2:], slot_mapping, heads))
        assert torch.equal(fused, plain)
        for fused_pool, plain_pool in zip(pools[2:], pools[:2], strict=True):
            assert torch.equal(fused_pool[: slots - 1], plain_pool[: slots - 1])
    assert int(small_gemm._counters(x.device).abs().sum()) == 0


@gpu
@needs_ws
@pytest.mark.parametrize("m", [1, 5, 8, 16, 32, 64])
@pytest.mark.parametrize("name", ["ouro_o", "ouro_down", "nanbeige_down"])
def test_gpu_unreduced_partials_sum_to_the_gemm_bit_for_bit(name, m):
    """`unreduced`: the split-K partials, summed in split order and rounded (SplitSums.total,
    or the add + norm launch that reads them), are the GEMM's output bit for bit; no counter
    touched; without split-K the plain output; inside a CUDA graph the same."""
    from rlt_engine.kernels.norm_chain import add_rms_norm
    from rlt_engine.kernels.split_sums import SplitSums
    from rlt_engine.kernels.ws_gemm import ws_gemm

    (n, k), configs = SHAPES[name]
    x, w = make(m, n, k, torch.bfloat16, device="cuda", seed=m)
    g = torch.Generator(device="cuda").manual_seed(m)
    res = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    norm_w = (torch.rand(n, device="cuda", generator=g) + 0.5).bfloat16()
    configs = fitting(n, k, m, configs)
    for config in configs:
        plain = ws_gemm(x, w, config)
        parts = ws_gemm(x, w, config, unreduced=True)
        assert isinstance(parts, SplitSums) and parts.parts.shape == (config.split_k, m, n)
        assert torch.equal(parts.total(), plain)
        chain = add_rms_norm(parts, res, norm_w, 1e-6, norm_w, 1e-6)
        for got, want in zip(
            chain, add_rms_norm(plain, res, norm_w, 1e-6, norm_w, 1e-6), strict=True
        ):
            assert torch.equal(got, want)
    if m <= 32:  # without split-K the output (64 rows of K = 2048 do not fit one program)
        x1, w1 = make(m, 2048, 2048, torch.bfloat16, device="cuda", seed=m)
        unsplit = ws_gemm(x1, w1, ws(64, 128, 1, 2), unreduced=True)
        assert isinstance(unsplit, torch.Tensor)
        assert torch.equal(unsplit, ws_gemm(x1, w1, ws(64, 128, 1, 2)))
    config = configs[0]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        add_rms_norm(ws_gemm(x, w, config, unreduced=True), res, norm_w, 1e-6)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = add_rms_norm(ws_gemm(x, w, config, unreduced=True), res, norm_w, 1e-6)
    graph.replay()
    torch.cuda.synchronize()
    want = add_rms_norm(ws_gemm(x, w, config), res, norm_w, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(captured, want, strict=True))
    assert int(small_gemm._counters(x.device).abs().sum()) == 0


# Every ws row of the small-GEMM tables and of the screens' variants files
# (benchmarks/variants/*.args), compiled for sm_90 as `ws_gemm.launch` launches it: the qkv of
# a bundled model's config with its RoPE epilogue, its gate/up with SwiGLU, every other
# weight with its split-K partials left to the add + norm (decode's routes), at the bucket's
# largest row count.
_COMPILE_ROWS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from rlt_engine.kernels import ws_gemm
from rlt_engine.kernels.small_gemm import GemmConfig

fn = ws_gemm._build()
names = fn.arg_names
jobs = json.loads(sys.argv[2])
report = {}
for job in jobs:
    config = GemmConfig(*job["config"], kernel="ws")
    plan = ws_gemm.launch(job["n"], job["k"], job["m"], config, job["swiglu"], job["rope_d"],
                          job["unreduced"])
    c, bk, g = plan.constexprs, config.block_k, gl.bfloat16
    def desc(rows, layout_rows):
        layout = gl.NVMMASharedLayout.get_default_for([layout_rows, bk], g)
        return f"tensordesc<bf16[{rows}, {bk}],{layout!r}>"
    sig = {n: "i32" for n in names} | dict.fromkeys(c, "constexpr") | {
        "x_ptr": "*bf16", "x_desc": desc(c["BM"], c["BM"]), "w_desc": desc(plan.box, c["BN"]),
        "out_ptr": "*bf16", "part_ptr": "*fp32", "tick_ptr": "*i32", "probe_ptr": "*i64",
        "cos_ptr": "*bf16", "sin_ptr": "*bf16", "kpool_ptr": "*bf16", "vpool_ptr": "*bf16",
        "slot_ptr": "*i64"}
    aligned = [a for a in names if a.endswith("_ptr") or a == "K"]
    src = GluonASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in c.items()},
                         attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    options = dict(num_warps=4) | ({} if plan.maxnreg is None else {"maxnreg": plan.maxnreg})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    report[job["name"]] = {"usage": ptxas_usage(kernel.asm["ptx"]), "maxnreg": plan.maxnreg,
                           "shared": kernel.metadata.shared}
print(json.dumps(report))
"""


def _row_jobs() -> list[dict]:
    import benchmark_scripts

    from rlt_engine.kernels.small_gemm_tables import TABLES

    screen = benchmark_scripts.load("screen_chain")
    rows = [
        (f"{t['device']}[{key}]", key, row) for t in TABLES for key, row in t["entries"].items()
    ]
    for path in sorted((benchmark_scripts.ROOT / "benchmarks" / "variants").glob("*.args")):
        for variant in screen.parser().parse_args(["--out", "unused", f"@{path}"]).variants:
            rows += [(f"{path.name}:{variant.name}[{k}]", k, r) for k, r in variant.rows]
    forms, jobs, seen = decode_forms(), [], set()
    for name, key, row in rows:
        shape, bucket, dtype = key.split(":")
        if row[0] != "ws" or dtype != "bfloat16":
            continue
        n, k = map(int, shape.split("x"))
        form = {"swiglu": False, "rope_d": 0} | forms.get((n, k), {})
        job = {"n": n, "k": k, "m": int(bucket[1:]), "config": list(row[1:6]), **form}
        job["unreduced"] = not (job["swiglu"] or job["rope_d"])
        ident = json.dumps(job, sort_keys=True)
        if ident not in seen:
            seen.add(ident)
            jobs.append({"name": name, **job})
    return jobs


def test_every_table_and_variant_row_compiles_as_launched_without_spills():
    """Each ws row the engine may run (the tables) or a screen may try (the variants files)
    builds for sm_90a in its decode form as `ws_gemm.launch` gives it: no spill stores (local
    memory traffic in the weight stream), at most TWO_PER_SM_REGISTERS a thread where two
    programs share an SM, and shared memory within what that leaves a program."""
    from rlt_engine.kernels.ws_gemm import HALF_SM_SHARED, SHARED_LIMIT, TWO_PER_SM_REGISTERS

    jobs = _row_jobs()
    assert len(jobs) > 20
    script = TRITON_PTX + _COMPILE_ROWS.replace("sys.argv[2]", repr(json.dumps(jobs)))
    report = run_compile_script(script)
    assert set(report) == {job["name"] for job in jobs}
    for name, r in report.items():
        registers, spilled = r["usage"]
        assert spilled == 0, (name, registers, spilled)
        two = r["maxnreg"] is not None
        assert not two or (r["maxnreg"] == TWO_PER_SM_REGISTERS and registers <= r["maxnreg"])
        assert r["shared"] <= (HALF_SM_SHARED if two else SHARED_LIMIT), (name, r["shared"])


def test_which_launches_release_their_successor_at_their_end(monkeypatch):
    """LATE: the qkv with its RoPE epilogue from LATE_RELEASE_ROWS' rows (2 unless listed); a
    plain GEMM only from LATE_RELEASE_PLAIN_ROWS' (an A/B switch, empty)."""
    from rlt_engine.kernels import ws_gemm

    cfg = GemmConfig(64, 256, 2, 4, 5, kernel="ws")
    late = lambda n, k, m, **kw: ws_gemm.launch(n, k, m, cfg, **kw).constexprs["LATE"]  # noqa: E731
    assert [late(6144, 2048, m, rope_d=128) for m in (1, 2, 4)] == [False, False, True]
    assert [late(8192, 3072, m, rope_d=128) for m in (1, 2)] == [False, True]
    assert not any(late(3072, 10752, m) or late(6144, 2048, m) for m in (1, 8, 64))
    monkeypatch.setattr(ws_gemm, "LATE_RELEASE_PLAIN_ROWS", {(3072, 10752): 1})
    assert late(3072, 10752, 1, unreduced=True) and not late(3072, 6144, 1)
    assert not late(6144, 2048, 2, rope_d=128)  # the RoPE rule unchanged
    # the launch's PDL word is the caller's (pdl.enabled on the device)
    assert ws_gemm.launch(3072, 10752, 1, cfg, pdl=False).constexprs["PDL"] is False
