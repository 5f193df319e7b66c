"""The traversal's row bookkeeping kernels (kernels/slot_step.py) against their torch
references, bit for bit: random slot states with running, parked and idle rows, exits at
max_loops and by the fp32 exit mass near its threshold, stop ids and max_tokens, refill and
no refill, with and without a gate hazard, drawn tokens given as tokens or as the greedy
argmax's partials (reduced by the advance); prepare's first-layer norm equal to the norm
kernel's and its exits to the exit rule's. CPU: the interpreter; GPU: compiled (with PDL on
sm_90+) and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlt_engine.kernels import argmax, norm, slot_step

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
DEVICE = "cuda" if CUDA else "cpu"
WINDOW, STOPS, HIDDEN = 3, 5, 24


def _state(b: int, seed: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def ints(lo: int, hi: int, *shape: int) -> torch.Tensor:
        return torch.randint(lo, hi, shape or (b,), generator=g)

    max_loops = ints(1, 5)
    state = {
        "loop": torch.minimum(ints(0, 4), max_loops - 1),
        "active": ints(0, 10) > 1,
        "parked": ints(0, 10) > 7,
        # exit masses and hazards chosen so that 1 - R * (1 - h) lands on both sides of the
        # thresholds, some within an ulp
        "remaining": torch.rand(b, generator=g),
        "hazard": torch.rand(b, generator=g),
        "min_loops": ints(1, 3),
        "max_loops": max_loops,
        "threshold": torch.where(ints(0, 4) == 0, 2.0, torch.rand(b, generator=g)),
        "token": ints(0, 50),
        "hidden": torch.randn(b, HIDDEN, generator=g),
        "new_hidden": torch.randn(b, HIDDEN, generator=g),
        "drawn": ints(0, 12),  # small vocabulary: stop ids hit often
        # the same draws as the greedy argmax's partials over a vocabulary of 12 (3 splits)
        "logits": torch.randint(-3, 3, (b, 12), generator=g).float(),
        "position": ints(0, 100),
        "generated": ints(0, 6),
        "max_tokens": ints(1, 8),
        "stop_ids": torch.where(ints(0, 3, b, STOPS) == 0, ints(0, 12, b, STOPS), -1),
        "event_token": torch.full((2 * WINDOW, b + 2), -7),
        "event_depth": torch.full((2 * WINDOW, b + 2), -7),
        "step": torch.tensor([1]),
        "base": torch.tensor([WINDOW]),  # the second half of a doubled buffer
        "ticket": torch.zeros(1, dtype=torch.int32),
    }
    near = ints(0, 3) == 0  # thresholds exactly at 1 - R * (1 - h): the >= decides
    exact = 1.0 - state["remaining"] * (1.0 - state["hazard"])
    state["threshold"] = torch.where(near, exact, state["threshold"])
    state["drawn"] = state["logits"].argmax(-1)
    return {k: v.to(device) for k, v in state.items()}


def _partials(logits: torch.Tensor) -> argmax.Partials:
    """The argmax's partials of `logits` over splits of 4 entries (the first best of each)."""
    rows, vocab = logits.shape
    split = logits.view(rows, vocab // 4, 4)
    best, at = split.max(-1)  # torch's max returns the first index of the maximum
    index = at + torch.arange(0, vocab, 4, device=logits.device)
    return argmax.Partials(best, index.int())


def _run(
    state: dict[str, torch.Tensor],
    fused: bool,
    hazard: bool,
    refill: bool,
    step_up: bool = True,
    partials: bool = False,
):
    s = {k: v.clone() for k, v in state.items()}
    rule = slot_step.exit_rule if fused else slot_step.exit_rule_reference
    advance = slot_step.advance if fused else slot_step.advance_reference
    early = None
    if hazard:
        early = slot_step.EarlyExit(s["remaining"], s["hazard"], s["min_loops"], s["threshold"])
    exits, gate = rule(s["loop"], s["active"], s["parked"], s["max_loops"], early)
    decided = (exits.clone(), bool(gate.item()))
    drawn = _partials(s["logits"]) if partials else s["drawn"]
    h = s["hazard"] if hazard else None
    advance(exits, drawn, h, s["new_hidden"], *_rows_events(s), refill, step_up)
    return decided, s


def _rows_events(s: dict[str, torch.Tensor]) -> tuple[slot_step.Rows, slot_step.Events]:
    rows = slot_step.Rows(*(s[name] for name in slot_step.Rows._fields))
    events = slot_step.Events(s["event_token"], s["event_depth"], s["step"], s["base"], s["ticket"])
    return rows, events


def _check(
    b: int, seed: int, hazard: bool, refill: bool, device: str, step_up: bool, partials: bool
) -> None:
    state = _state(b, seed, device)
    (exits, gate), want = _run(state, False, hazard, refill, step_up)
    (f_exits, f_gate), got = _run(state, True, hazard, refill, step_up, partials)
    assert torch.equal(f_exits, exits)
    assert f_gate == gate == bool(exits.any())
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # the events went to row base + step, every slot of the b rows and nothing else
    row = state["base"].item() + state["step"].item()
    for name in ("event_token", "event_depth"):
        written = got[name] != -7
        assert written[row, :b].all() and written.sum() == b, name
    # the row counter moved on once (by the last of b programs), the ticket back at zero
    assert got["step"].item() == state["step"].item() + step_up
    assert got["ticket"].item() == 0


@pytest.mark.parametrize("hazard", [True, False])
@pytest.mark.parametrize("refill", [True, False])
@pytest.mark.parametrize("b", [1, 7, 19])
def test_kernels_equal_the_torch_reference(b, hazard, refill):
    for seed in range(3):
        _check(b, seed + 10 * b, hazard, refill, DEVICE, seed != 1, partials=seed == 2)


def test_the_reference_reduces_partials_like_the_kernel():
    """The advance's reference given the partials equals itself given the tokens (and the
    kernel matches both, above): ties and NaNs take the first index, as torch's argmax."""
    state = _state(19, 5, "cpu")
    state["logits"][3] = float("nan")
    state["logits"][4, 5] = float("nan")
    state["drawn"] = state["logits"].argmax(-1)
    assert state["drawn"][3] == 0 and state["drawn"][4] == 5
    _, want = _run(state, False, True, True)
    _, got = _run(state, False, True, True, partials=True)
    for name in want:  # bit for bit (the NaN logits too)
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, equal_nan=True)
    _, fused = _run({k: v.to(DEVICE) for k, v in state.items()}, True, True, True, partials=True)
    for name in want:
        torch.testing.assert_close(fused[name].cpu(), want[name], rtol=0, atol=0, equal_nan=True)


def test_the_workload_reaches_every_branch():
    """The random states really exit both ways, finish both ways, and keep some rows idle."""
    seen = set()
    for seed in range(20):
        state = _state(19, seed, "cpu")
        (exits, _), s = _run(state, False, True, True)
        run = state["active"] & ~state["parked"]
        early = exits & (state["loop"] + 1 < state["max_loops"])
        stopped = (state["drawn"][:, None] == state["stop_ids"]).any(1)
        finished = state["active"] & ~s["active"]
        seen |= {
            ("early", bool(early.any())),
            ("at max", bool((exits & ~early).any())),
            ("idle", bool((~run).any())),
            ("stop id", bool((finished & stopped).any())),
            ("max tokens", bool((finished & ~stopped).any())),
        }
    assert all(
        (name, True) in seen for name in ("early", "at max", "idle", "stop id", "max tokens")
    )


def _prepare_inputs(b: int, seed: int, width: int, device: str) -> dict:
    g = torch.Generator().manual_seed(seed)
    block_size, planes = 4, 3
    return {
        "loop": torch.randint(0, planes, (b,), generator=g).to(device),
        # up to one past the tables (an idle row's last token): clamped, never written
        "position": torch.randint(0, width * block_size + 1, (b,), generator=g).to(device),
        "active": (torch.randint(0, 4, (b,), generator=g) > 0).to(device),
        "parked": (torch.randint(0, 4, (b,), generator=g) == 0).to(device),
        "token": torch.randint(0, 50, (b,), generator=g).to(device),
        "embedding": torch.randn(50, HIDDEN, generator=g).to(device),
        "hidden": torch.randn(b, HIDDEN, generator=g).to(device),
        "block_tables": torch.randint(0, 1000, (b, planes, width), generator=g)
        .to(torch.int32)
        .to(device),
        "block_size": block_size,
        "trash_slot": 4000,
    }


@pytest.mark.parametrize("extras", [False, True])  # RoPE, the first norm and the exits
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("b,width", [(1, 3), (9, 5), (6, 1100)])
def test_prepare_equals_the_torch_reference(b, width, shared, extras):
    """Every output, the embedding rows of loop-0 rows and (given the table) the RoPE rows of
    the positions, those past the table (idle rows) zero, equal to the torch reference; the
    first norm equal to the norm kernel's (to the torch reference's within its rounding), the
    exits and gate to the exit rule's."""
    rope = extras
    for seed in range(2):
        inputs = _prepare_inputs(b, seed, width, DEVICE)
        g = torch.Generator().manual_seed(seed)
        if extras:  # fewer rows than positions: some rows read past it
            inputs["rope_table"] = torch.randn(width * 2, 2, 6, generator=g).to(DEVICE)
            inputs["norm"] = (torch.randn(HIDDEN, generator=g).to(DEVICE), 1e-6)
            inputs["max_loops"] = torch.randint(1, 4, (b,), generator=g).to(DEVICE)
            if seed == 1:  # bf16 rows: the norm's roundings to bf16
                for name in ("embedding", "hidden"):
                    inputs[name] = inputs[name].bfloat16()
        want = slot_step.prepare_reference(**inputs, shared=shared)
        got = slot_step.prepare(**inputs, shared=shared)
        assert (want.rope is None) == (got.rope is None) == (not rope)
        skip = {"rope", "normed", "gate"}
        fields = zip(want._fields, want, got, strict=True)
        pairs = [(n, w, o) for n, w, o in fields if n not in skip]
        if rope:
            pairs += [("cos", want.rope[0], got.rope[0]), ("sin", want.rope[1], got.rope[1])]
        for name, w, o in pairs:
            if w is None:
                assert o is None, name
                continue
            assert o.dtype == w.dtype and torch.equal(o, w), name
        if extras:
            assert torch.equal(got.normed, norm.rms_norm(got.x, *inputs["norm"]))
            torch.testing.assert_close(got.normed, want.normed)
            exits, gate = slot_step.exit_rule(
                inputs["loop"], inputs["active"], inputs["parked"], inputs["max_loops"]
            )
            assert torch.equal(got.exits, exits) and got.gate.item() == gate.item()
            assert got.gate.item() == want.gate.item()
        else:
            assert got.normed is got.exits is got.gate is None
        x = torch.where(
            (inputs["loop"] == 0)[:, None], inputs["embedding"][inputs["token"]], inputs["hidden"]
        )
        assert torch.equal(got.x, x)
        if rope:
            table, pos = inputs["rope_table"], inputs["position"]
            inside = pos < table.shape[0]
            assert torch.equal(got.rope[0][inside], table[pos[inside], 0])
            assert torch.equal(got.rope[1][inside], table[pos[inside], 1])
            assert not got.rope[0][~inside].any() and not got.rope[1][~inside].any()


@gpu
@needs_cuda
@pytest.mark.parametrize("hidden", [2048, 3072])  # Ouro, Nanbeige4.2-3B
def test_gpu_prepare_norm_is_the_norm_kernels_bit_for_bit(hidden):
    """At the models' widths in bf16 the prepare's first-layer norm equals the norm kernel's
    bits: the same fp32 sum tree (norm.num_warps_for) and roundings, so the traversal's
    tokens do not depend on which launch normalised the rows."""
    g = torch.Generator().manual_seed(hidden)
    b, width, planes = 8, 4, 4  # loops 0..3: a plane each
    inputs = {
        "loop": torch.tensor([0, 1, 0, 2, 1, 0, 3, 1]),
        "position": torch.randint(0, width * 16, (b,), generator=g),
        "active": torch.ones(b, dtype=torch.bool),
        "parked": torch.zeros(b, dtype=torch.bool),
        "token": torch.randint(0, 100, (b,), generator=g),
        "embedding": torch.randn(100, hidden, generator=g).bfloat16(),
        "hidden": (torch.randn(b, hidden, generator=g) * 3).bfloat16(),
        "block_tables": torch.randint(0, 50, (b, planes, width), generator=g).int(),
        "norm": (torch.rand(hidden, generator=g).bfloat16() + 0.5, 1e-6),
    }
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    inputs["norm"] = (inputs["norm"][0].cuda(), 1e-6)
    got = slot_step.prepare(**inputs, block_size=16, trash_slot=999, shared=False)
    assert torch.equal(got.normed, norm.rms_norm(got.x, *inputs["norm"]))


@gpu
@needs_cuda
def test_gpu_graph_replay_equals_the_reference():
    b = 64
    state = _state(b, 3, "cuda")
    _, want = _run(state, False, True, True)
    s = {k: v.clone() for k, v in state.items()}

    def step():
        early = slot_step.EarlyExit(s["remaining"], s["hazard"], s["min_loops"], s["threshold"])
        exits, _ = slot_step.exit_rule(s["loop"], s["active"], s["parked"], s["max_loops"], early)
        rows, events = _rows_events(s)
        partials = _partials(s["logits"])
        slot_step.advance(exits, partials, s["hazard"], s["new_hidden"], rows, events, True, True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for name in s:
        s[name].copy_(state[name])
    graph.replay()
    torch.cuda.synchronize()
    for name in want:
        assert torch.equal(s[name], want[name]), name
    graph.replay()  # the ticket was left at zero: the row counter moves on once more
    assert s["step"].item() == want["step"].item() + 1 and s["ticket"].item() == 0


# compiled in a process of its own: this one imported triton for the interpreter
_COMPILE = """
from rlt_engine.kernels import paged_attention, slot_step

slot_step._import_triton()
out = {}


def compile(kernel, const, num_warps, **types):
    fn = paged_attention._kernel(kernel, False)
    sig = {n: "*i64" for n in fn.arg_names if n.endswith("_ptr")} | types
    bools = ("active_ptr", "parked_ptr", "exits_ptr", "run_ptr")
    sig |= {n: "*i1" for n in bools if n in fn.arg_names}
    return triton_ptx(fn, const, sig, num_warps=num_warps)


out["prepare"] = compile(
    slot_step._prepare_kernel,
    dict(BLOCK_H=2048, BLOCK_W=64, BLOCK_D=64, BLOCK_B=16, INV_H=1.0 / 2048, ROPE=True,
         NORM=True, EXITS=True, SHARED=False, EXACT_MUL=True, ROUND_BF16=False, PDL=True),
    8, embedding_ptr="*bf16", hidden_ptr="*bf16", tables_in_ptr="*i32", x_ptr="*bf16",
    tables_ptr="*i32", seq_lens_ptr="*i32", rope_table_ptr="*bf16", rope_ptr="*bf16",
    norm_w_ptr="*bf16", normed_ptr="*bf16", eps="fp32", gate_ptr="*i32",
)
out["exit_rule"] = compile(
    slot_step._exit_rule_kernel, dict(BLOCK=16, EARLY=True, EXACT_MUL=True, PDL=True), 4,
    remaining_ptr="*fp32", hazard_ptr="*fp32", threshold_ptr="*fp32", gate_ptr="*i32",
)
out["advance"] = compile(
    slot_step._advance_kernel,
    dict(BLOCK_H=2048, BLOCK_S=8, BLOCK_SPLITS=1024, HAS_HAZARD=True, EXACT_MUL=True,
         REFILL=False, STEP_UP=True, PDL=True),
    4, drawn_ptr="*fp32", drawn_i_ptr="*i32", hazard_ptr="*fp32", new_hidden_ptr="*bf16",
    hidden_ptr="*bf16", remaining_ptr="*fp32", ticket_ptr="*i32",
)
print(json.dumps({name: [ptxas_usage(ptx), ptx] for name, ptx in out.items()}))
"""


def test_compiles_for_sm90_with_the_loads_before_the_stores():
    """Every variant's widest form (RoPE, the first norm and the exits in prepare; the early
    exit; partials, the hazard and the ticket in advance) builds for sm_90 without spills, and
    the advance issues every load before its first store, prepare all but the long tables'
    (their copy loop): no round trip waits behind a store (see _advance_kernel)."""
    from sm90_compile import TRITON_PTX, run_compile_script

    for name, ((_, spilled), ptx) in run_compile_script(TRITON_PTX + _COMPILE).items():
        assert spilled == 0, name
        kinds = [
            "ld" if "ld.global" in line else "st"
            for line in ptx.splitlines()
            if "ld.global" in line or "st.global" in line
        ]
        assert "st" in kinds, name
        late_loads = kinds[kinds.index("st") :].count("ld")
        assert late_loads == (1 if name == "prepare" else 0), name
