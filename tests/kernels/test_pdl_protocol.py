"""The PDL protocol (kernels/pdl.py), checked on the kernels' source: in every Triton kernel
with a `PDL` constexpr, nothing before its `if PDL:` block reads or writes memory or returns
(but loads of the model parameters and host-uploaded memory it names in PRE_WAIT_READS, and
in the kernels of IDLE_BEFORE_WAIT the return of a program with nothing to do), and that block
waits (`gdc_wait`) before it releases the next kernel (`gdc_launch_dependents`), touching memory
only through L2 prefetch hints (`prefetch_l2` of weights, `prefetch_lines`, `prefetch_kv_l2`
of K/V rows through the block table and seq_lens, which the kernel before a decode attention
launch never writes) before the wait. A kernel whose caller vouches for what the kernel
before never writes (X, such as paged attention's SETTLED) may instead have `if PDL and
not X:` then `if PDL and X:`, and between them only load that memory (EARLY_READS) or return
a program with nothing to do (`if ...: return`, a condition of index arithmetic). A kernel
that releases late has its release inside the wait's block under `if not LATE:` and a last
`if PDL and LATE:` block that only releases; one that releases early (the add + norm's EARLY)
has a release under `if EARLY:` before the wait and one under `if not EARLY:` after it. A
kernel that broke this would race with its predecessor only on sm_90+ GPUs, and only
sometimes; this test fails on any machine the moment such a kernel is written. Also: every
launch that passes `launch_options(pdl)` passes `PDL=pdl` too (launched with PDL <=> compiled
with the wait)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "rlt_engine" / "kernels"
# calls allowed before the wait: index arithmetic, no memory access
PURE = {"program_id", "num_programs", "arange", "minimum", "maximum", "zeros", "to", "where"}
PURE |= {"cdiv", "sum"}  # sum: a reduction of registers
# pdl.clocks, ws_gemm's now: read the timers (a PROBE build's stamps), no memory
PURE |= {"clocks", "now"}


def _kernels_with_pdl() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                found.append((f"{path.name}::{node.name}", node))
    return found


def _calls(node: ast.AST) -> list[str]:
    names = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            names.append(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "?"))
    return names


def _is_pdl_block(stmt: ast.stmt) -> bool:
    """`if PDL:`, or `if PDL and [not] X:` (X a constexpr: the wait placed by X)."""
    if not isinstance(stmt, ast.If):
        return False
    test = stmt.test
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        test = test.values[0]
    return isinstance(test, ast.Name) and test.id == "PDL"


def _condition(stmt: ast.If) -> str:
    """'' for `if PDL:`, 'X' for `if PDL and X:`, 'not X' for `if PDL and not X:`."""
    if not isinstance(stmt.test, ast.BoolOp):
        return ""
    x = stmt.test.values[1]
    if isinstance(x, ast.UnaryOp) and isinstance(x.op, ast.Not):
        return f"not {x.operand.id}"
    return x.id


def _is_probe_only(stmt: ast.stmt) -> bool:
    """`if PROBE:` with timer stamps only (after a late release)."""
    return (
        isinstance(stmt, ast.If)
        and isinstance(stmt.test, ast.Name)
        and stmt.test.id == "PROBE"
        and set(_calls(stmt)) <= {"stamp", "now"}
    )


def _has_if(block: ast.If, condition: str) -> bool:
    """Whether `block` holds an `if <condition>:` (e.g. 'not LATE') around a release."""
    for sub in ast.walk(block):
        if isinstance(sub, ast.If) and ast.unparse(sub.test) == condition:
            return "gdc_launch_dependents" in _calls(sub)
    return False


# Memory a kernel may read between `if PDL and not X:` and `if PDL and X:` (before the wait
# when X holds): X is its caller's word that the kernel before writes none of it.
# paged_attention's SETTLED (prefetch_kv's word, decode): the sequences' metadata (query_start,
# seq_lens, the block table) and the keys older than the rows' own (through k_base / v_base).
EARLY_READS = {"SETTLED": {"query_start_ptr", "seq_lens_ptr", "table", "k_base", "v_base"}}
# pointers derived from a kernel argument (names that do not end in _ptr)
DERIVED = {"table", "k_base", "v_base"}
# calls that only load: tl.load, paged attention's _kv_tile (K and V rows at given slots)
LOADERS = {"load", "kv_tile"}


# Memory a kernel may load before its `if PDL:` block: model parameters (no kernel writes
# them), such as the add + norm's weights, which the layer's weight stream has evicted from L2;
# and memory only the host writes (uploaded before the wave's first kernel, which is launched
# without PDL): paged attention's FLAT prefill finds its sequence in query_start.
PRE_WAIT_READS = {
    "norm_chain.py::_add_rms_norm_kernel": {"w_ptr", "wy_ptr", "gw_ptr", "gb_ptr"},
    "paged_attention.py::_paged_attention_kernel": {"query_start_ptr"},
}
# Kernels whose programs with nothing to do may return before the wait (`if ...: return`),
# because some program of every launch waits, so the launch still completes after the kernel
# before it: a FLAT prefill block past its sequence's queries (every wave has a row, so some
# sequence has queries). A gated GEMM may not: all its programs can be idle at once.
IDLE_BEFORE_WAIT = {"paged_attention.py::_paged_attention_kernel"}


def _pointers(node: ast.AST) -> set[str]:
    return {
        n.id
        for n in ast.walk(node)
        if isinstance(n, ast.Name) and (n.id.endswith("_ptr") or n.id in DERIVED)
    }


def _is_idle_return(stmt: ast.stmt) -> bool:
    """`if <condition>: return` (nothing else): a program that leaves with nothing to do."""
    return (
        isinstance(stmt, ast.If)
        and not stmt.orelse
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], ast.Return)
        and stmt.body[0].value is None
    )


def _assert_loads_only(
    name: str, stmt: ast.stmt, readable: set[str], idle_returns: bool = False
) -> None:
    """A statement before the wait: no return (with `idle_returns`, but those of programs
    with nothing to do), and no call but index arithmetic and loads through pointers in
    `readable`."""
    idle = {id(s.body[0]) for s in ast.walk(stmt) if _is_idle_return(s)} if idle_returns else set()
    for ret in (r for r in ast.walk(stmt) if isinstance(r, ast.Return)):
        assert id(ret) in idle, f"{name}: returns before the wait (line {ret.lineno})"
    for call in (c for c in ast.walk(stmt) if isinstance(c, ast.Call)):
        callee = _calls(call)[0]
        if callee in LOADERS:  # loads through the pointers among its arguments
            read = _pointers(call.args[0] if callee == "load" else ast.Tuple(call.args))
            assert read and read <= readable, f"{name}: loads {read} before the wait"
        else:
            assert callee in PURE, f"{name}: {callee} before the wait (line {stmt.lineno})"


def _partitions(fn: ast.FunctionDef) -> list[str] | None:
    """The partition functions a Gluon kernel hands to `warp_specialize`, or None."""
    for sub in ast.walk(fn):
        if isinstance(sub, ast.Call) and _calls(sub)[:1] == ["warp_specialize"]:
            return [part.elts[0].id for part in sub.args[0].elts]
    return None


# a warp-specialised kernel is checked through its partitions: the one given PDL as a kernel
KERNEL_DEFS = [(n, f) for n, f in _kernels_with_pdl() if _partitions(f) is None]
SPECIALISED = [(n, f) for n, f in _kernels_with_pdl() if _partitions(f) is not None]
# what a kernel body may do before handing over to its partitions, and all a partition without
# the wait may do: stream weights (TMA copies of `w_desc`) through mbarriers
SETUP = {"allocate_shared_memory", "MBarrierLayout", "init", "index", "static_range"}
SETUP |= {"SwizzledSharedLayout"}  # the RoPE epilogue's exchange buffer
WEIGHT_STREAM = {
    "program_id",
    "range",
    "static_range",
    "wait",
    "expect",
    "index",
    "slice",  # RoPE's two half boxes a stage
    "async_copy_global_to_shared",
}
# and, in a PROBE build, its timer stamps: `stamp` writes the launch's own probe row, which no
# other kernel reads or writes (checked below)
PROBE_STAMPS = {"now", "stamp"}


def test_the_pdl_kernels_are_found():
    names = {name.split("::")[1] for name, _ in KERNEL_DEFS}
    assert {"_small_gemm_kernel", "_paged_attention_kernel", "_advance_kernel"} <= names


@pytest.mark.parametrize("name,fn", KERNEL_DEFS, ids=[n for n, _ in KERNEL_DEFS])
def test_nothing_touches_memory_before_the_wait(name, fn):
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    blocks = [i for i, s in enumerate(body) if _is_pdl_block(s)]
    conditions = [_condition(body[i]) for i in blocks]
    forms = [[""], ["", "LATE"]] + [[f"not {x}", x] for x in EARLY_READS]
    assert conditions in forms, (
        f"{name}: one `if PDL:` block, or `if PDL and not X:` then `if PDL and X:` expected"
    )
    if conditions == ["", "LATE"]:  # the late release: its own block, the kernel's last
        assert blocks[1] == len(body) - 1 or all(
            _is_probe_only(stmt) for stmt in body[blocks[1] + 1 :]
        ), f"{name}: the late release must end the kernel"
        assert _calls(body[blocks[1]]) == ["gdc_launch_dependents"], name
        early = [c for c in _calls(body[blocks[0]]) if c == "gdc_launch_dependents"]
        assert early and _has_if(body[blocks[0]], "not LATE"), name
        blocks = blocks[:1]
    for stmt in body[: blocks[0]]:  # before the first block: loads of parameters only
        _assert_loads_only(name, stmt, PRE_WAIT_READS.get(name, set()), name in IDLE_BEFORE_WAIT)
    if len(blocks) == 2:  # between them: loads of what the kernel before never writes (X),
        # and the return of a program with nothing to do (decided from those loads)
        for stmt in body[blocks[0] + 1 : blocks[1]]:
            if _is_idle_return(stmt):
                assert set(_calls(stmt.test)) <= PURE, f"{name}: line {stmt.lineno}"
                continue
            _assert_loads_only(name, stmt, EARLY_READS[conditions[1]])
    for i in blocks:
        block = body[i].body
        calls = [c for stmt in block for c in _calls(stmt)]
        assert "gdc_wait" in calls and "gdc_launch_dependents" in calls, name
        release = calls.index("gdc_launch_dependents")
        if release < calls.index("gdc_wait"):  # an early release: under `if EARLY:`, and the
            # release after the wait under `if not EARLY:`
            assert _has_if(body[i], "EARLY") and _has_if(body[i], "not EARLY"), name
            calls = calls[:release] + calls[release + 1 :]
        assert calls.index("gdc_wait") < calls.index("gdc_launch_dependents"), name
        before = calls[: calls.index("gdc_wait")]
        allowed = PURE | {"prefetch_l2", "prefetch_kv_l2", "prefetch_lines"}
        assert set(before) <= allowed, f"{name}: {before} before the wait"


def test_warp_specialised_kernels_are_found():
    assert "ws_gemm.py::ws_gemm_kernel" in {name for name, _ in SPECIALISED}
    assert "ws_gemm.py::consumer" in {name for name, _ in KERNEL_DEFS}


@pytest.mark.parametrize("name,fn", SPECIALISED, ids=[n for n, _ in SPECIALISED])
def test_warp_specialised_partitions_wait_or_only_stream_weights(name, fn):
    """The kernel body only sets up shared memory; one partition takes PDL (and is checked as
    a kernel above); every other one only copies weight tiles: it never waits, and needs not."""
    body_calls = [c for stmt in fn.body for c in _calls(stmt)]
    assert set(body_calls[: body_calls.index("warp_specialize")]) <= SETUP, name
    module = ast.parse((KERNELS / name.split("::")[0]).read_text())
    defs = {d.name: d for d in ast.walk(module) if isinstance(d, ast.FunctionDef)}
    parts = [defs[p] for p in _partitions(fn)]
    waiting = [p for p in parts if any(a.arg == "PDL" for a in p.args.args)]
    assert len(waiting) == 1, f"{name}: one partition waits for the kernel before"
    for part in parts:
        if part is waiting[0]:
            continue
        calls = set(_calls(part))
        assert calls <= WEIGHT_STREAM | PROBE_STAMPS, f"{name}: {part.name} {calls}"
        if "stamp" in calls:
            stores = [
                c for c in ast.walk(defs["stamp"])
                if isinstance(c, ast.Call) and _calls(c)[:1] == ["store"]
            ]  # fmt: skip
            assert stores and all(_pointers(c.args[0]) == {"probe_ptr"} for c in stores)
        copies = [c for c in ast.walk(part) if isinstance(c, ast.Call) and
                  _calls(c)[:1] == ["async_copy_global_to_shared"]]  # fmt: skip
        assert copies and all(c.args[0].id == "w_desc" for c in copies), part.name


def test_every_pdl_launch_compiles_the_wait():
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            unpacked = [k.value for k in node.keywords if k.arg is None]
            if not any("launch_options" in _calls(v) for v in unpacked):
                continue
            given = {k.arg for k in node.keywords if k.arg is not None}
            # **shapes (or ws_gemm's **plan.constexprs, from ws_gemm.launch) carries PDL
            shapes = any(isinstance(v, (ast.Name, ast.Attribute)) for v in unpacked)
            assert "PDL" in given or shapes, f"{path.name}:{node.lineno}: PDL= not passed"
