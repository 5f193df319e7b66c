"""The traversal's row bookkeeping kernels (kernels/slot_step.py) against their torch
references, bit for bit: random slot states with running, parked and idle rows, exits at
max_loops and by the fp32 exit mass near its threshold, stop ids and max_tokens, refill and
no refill, with and without a gate hazard. CPU: the interpreter; GPU: compiled (with PDL on
sm_90+) and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlt_engine.kernels import slot_step

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
        "position": ints(0, 100),
        "generated": ints(0, 6),
        "max_tokens": ints(1, 8),
        "stop_ids": torch.where(ints(0, 3, b, STOPS) == 0, ints(0, 12, b, STOPS), -1),
        "event_token": torch.full((WINDOW, b + 2), -7),
        "event_depth": torch.full((WINDOW, b + 2), -7),
        "step": torch.tensor([1]),
        "ticket": torch.zeros(1, dtype=torch.int32),
    }
    near = ints(0, 3) == 0  # thresholds exactly at 1 - R * (1 - h): the >= decides
    exact = 1.0 - state["remaining"] * (1.0 - state["hazard"])
    state["threshold"] = torch.where(near, exact, state["threshold"])
    return {k: v.to(device) for k, v in state.items()}


def _run(
    state: dict[str, torch.Tensor], fused: bool, hazard: bool, refill: bool, step_up: bool = True
):
    s = {k: v.clone() for k, v in state.items()}
    rule = slot_step.exit_rule if fused else slot_step.exit_rule_reference
    advance = slot_step.advance if fused else slot_step.advance_reference
    exits, remaining, gate = rule(
        s["loop"], s["active"], s["parked"], s["remaining"], s["hazard"] if hazard else None,
        s["min_loops"], s["max_loops"], s["threshold"],
    )  # fmt: skip
    decided = (exits.clone(), remaining.clone(), bool(gate.item()))
    advance(exits, s["drawn"], remaining, s["new_hidden"], *_rows_events(s), refill, step_up)
    return decided, s


def _rows_events(s: dict[str, torch.Tensor]) -> tuple[slot_step.Rows, slot_step.Events]:
    rows = slot_step.Rows(*(s[name] for name in slot_step.Rows._fields))
    return rows, slot_step.Events(s["event_token"], s["event_depth"], s["step"], s["ticket"])


def _check(b: int, seed: int, hazard: bool, refill: bool, device: str, step_up: bool) -> None:
    state = _state(b, seed, device)
    (exits, remaining, gate), want = _run(state, False, hazard, refill, step_up)
    (f_exits, f_remaining, f_gate), got = _run(state, True, hazard, refill, step_up)
    assert torch.equal(f_exits, exits)
    assert torch.equal(f_remaining, remaining)
    assert f_gate == gate == bool(exits.any())
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # the row counter moved on once (by the last of b programs), the ticket back at zero
    assert got["step"].item() == state["step"].item() + step_up
    assert got["ticket"].item() == 0


@pytest.mark.parametrize("hazard", [True, False])
@pytest.mark.parametrize("refill", [True, False])
@pytest.mark.parametrize("b", [1, 7, 19])
def test_kernels_equal_the_torch_reference(b, hazard, refill):
    for seed in range(3):
        _check(b, seed + 10 * b, hazard, refill, "cpu" if not CUDA else DEVICE, seed != 1)


def test_the_workload_reaches_every_branch():
    """The random states really exit both ways, finish both ways, and keep some rows idle."""
    seen = set()
    for seed in range(20):
        state = _state(19, seed, "cpu")
        (exits, _, _), s = _run(state, False, True, True)
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


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("b,width", [(1, 3), (9, 5), (6, 1100)])
def test_prepare_equals_the_torch_reference(b, width, shared, rope):
    """Every output, the embedding rows of loop-0 rows and (given the table) the RoPE rows of
    the positions, those past the table (idle rows) zero, equal to the torch reference."""
    for seed in range(2):
        inputs = _prepare_inputs(b, seed, width, DEVICE)
        if rope:  # fewer rows than positions: some rows read past it
            g = torch.Generator().manual_seed(seed)
            inputs["rope_table"] = torch.randn(width * 2, 2, 6, generator=g).to(DEVICE)
        want = slot_step.prepare_reference(**inputs, shared=shared)
        got = slot_step.prepare(**inputs, shared=shared)
        assert (want.rope is None) == (got.rope is None) == (not rope)
        pairs = [(n, w, o) for n, w, o in zip(want._fields, want, got, strict=True) if n != "rope"]
        if rope:
            pairs += [("cos", want.rope[0], got.rope[0]), ("sin", want.rope[1], got.rope[1])]
        for name, w, o in pairs:
            assert o.dtype == w.dtype and torch.equal(o, w), name
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
def test_gpu_graph_replay_equals_the_reference():
    b = 64
    state = _state(b, 3, "cuda")
    _, want = _run(state, False, True, True)
    s = {k: v.clone() for k, v in state.items()}

    def step():
        exits, remaining, _ = slot_step.exit_rule(
            s["loop"], s["active"], s["parked"], s["remaining"], s["hazard"],
            s["min_loops"], s["max_loops"], s["threshold"],
        )  # fmt: skip
        rows, events = _rows_events(s)
        slot_step.advance(exits, s["drawn"], remaining, s["new_hidden"], rows, events, True, True)

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
