"""Workloads for the engine property tests (test_engine_property.py,
test_memory_policies_property.py): hypothesis strategies that draw a workload's structure, a
driver that runs it step by step and records which mechanisms fired, the dense fp32 oracle
(memoised) to compare outputs with, and a tally of mechanisms across examples.

Everything is drawn field by field (request specs, prompts as token lists built from fixed
bases so shared prefixes are explicit, arrivals and aborts as step indices or events), so a
failing example shrinks to a small workload. The draws are biased towards the hard paths: pools
that hold about one request at full length, shared prompt prefixes of whole blocks, aborts
timed while a request is preempted (swapped out), mixed priorities.

Only public-ish engine surfaces are used: `LLM(...)`, `engine.add_request / step /
abort_request / has_unfinished_requests / cache_stats()`, the scheduler's `waiting / running /
swapped` request lists (request ids, params, prompt length, max positions) and the block
manager's `num_used / num_blocks / blocks_needed / owned_blocks`; nothing of the step plan.
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st
from safetensors.torch import load_file

from rlt_engine import LLM, SamplingParams
from rlt_engine.models.configs import load_config
from rlt_engine.oracle.reference import reference_greedy
from rlt_engine.oracle.reference_shared import shared_greedy

DEPTH = 4  # the tiny Ouro's loops
VOCAB = 49152
MAX_PROMPT = 40
MAX_NEW = 16
MAX_STEPS = 20_000

_rng = random.Random(20240508)
# Prompts start with a prefix of one of these (possibly empty), then a drawn tail: equal
# prefixes across requests are explicit in the draw, so prefix caching has something to hit.
BASES = tuple(tuple(_rng.randrange(3, VOCAB) for _ in range(MAX_PROMPT)) for _ in range(3))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------
# Workload description
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Abort:
    """When to abort a request: `kind` "step" = `at` steps after it was added; "running" =
    at the first step boundary where it is running with at least `at` output tokens.
    (Aborts of preempted requests are drawn per workload: `Workload.swapped_aborts`.)"""

    kind: str
    at: int = 0


@dataclass(frozen=True)
class Spec:
    prompt: tuple[int, ...]
    params: SamplingParams
    arrive: int  # step before which it is added, at the earliest
    after: int | None = None  # ... and not before request `after` is done (finished/aborted)
    abort: Abort | None = None

    @property
    def positions(self) -> int:
        return len(self.prompt) + self.params.max_tokens - 1


@dataclass(frozen=True)
class Workload:
    options: dict[str, Any]  # LLM(...) keywords
    specs: list[Spec]
    # abort the first preempted (swapped-out) request at the k-th step boundary at which one
    # is swapped out, for each k here
    swapped_aborts: tuple[int, ...] = ()


@dataclass(frozen=True)
class Axes:
    """What one property test varies."""

    block_sizes: tuple[int, ...]
    max_requests: int = 6
    max_num_seqs: int = 4
    sampled: bool = False  # seeded temperature sampling on some requests
    memory_knobs: bool = False  # watermark and max_bypass drawn (else engine defaults)


# Memory modes (kv_layout, incremental_kv, enable_preemption): each property test runs its
# examples once per mode, so every run covers every mode however hypothesis clusters its
# examples (it mutates a few novel ones rather than drawing each afresh); prefix caching and
# the scheduling policy are drawn within the mode.
MODES = (
    ("last_exited", True, True),  # growth preempts
    ("last_exited", False, True),  # priority preempts
    ("last_exited", True, False),  # growth reserved at admission
    ("last_exited", False, False),  # whole-lifetime reservation (the default)
    ("shared", True, True),
    ("shared", False, True),
)
MODE_IDS = tuple(
    f"{layout}-{'incr' if inc else 'whole'}{'-preempt' if pre else ''}"
    for layout, inc, pre in MODES
)


@st.composite
def prompts(
    draw: st.DrawFn, block_size: int, earlier: list[tuple[int, ...]]
) -> tuple[tuple[int, ...], int | None]:
    """A prefix of one of the BASES or of an earlier request's prompt (mostly whole blocks, so
    prefix caching can hit), then a drawn tail; sometimes exactly an earlier prompt. Returns
    the prompt and the index of the earlier request it extends (None: a base)."""
    modes = ["earlier", "base", "same", "base"] if earlier else ["base"]
    mode = draw(st.sampled_from(modes))
    source = None
    if mode == "base":
        text = BASES[draw(st.sampled_from([0, 0, 1, 0]))]
    else:
        source = draw(st.integers(0, len(earlier) - 1))
        text = earlier[source]
        if mode == "same":
            return text, source
    longest = min(len(text), MAX_PROMPT - 1)
    whole = st.integers(1, max(1, longest // block_size)).map(lambda k: k * block_size)
    shared = min(longest, draw(st.one_of(whole, st.integers(0, longest), whole)))
    tail = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=min(12, MAX_PROMPT - shared))
    return text[:shared] + tuple(draw(tail)), source


@st.composite
def sampling(draw: st.DrawFn, sampled: bool, priority: bool, late: bool) -> SamplingParams:
    """Loop controls from fixed depth to early exits; under priority, mixed values with
    latecomers (`late`) mostly more urgent, so they overtake or preempt the earlier ones."""
    max_loops = draw(st.sampled_from([DEPTH, 3, DEPTH, 2, 1]))
    temperature = draw(st.sampled_from([0.0, 1.0, 0.0, 0.0])) if sampled else 0.0
    presence, frequency, repetition, bias = draw(st.sampled_from(LOGIT_EDITS))
    return SamplingParams(
        max_tokens=draw(st.one_of(st.integers(MAX_NEW // 2, MAX_NEW), st.integers(1, MAX_NEW))),
        ignore_eos=True,
        min_loops=draw(st.integers(1, max_loops)),
        max_loops=max_loops,
        exit_threshold=draw(st.sampled_from([0.5, 0.3, 1.0, 0.0, 0.7])),
        temperature=temperature,
        top_k=50 if temperature else 0,
        seed=draw(st.integers(0, 999)) if temperature else None,
        priority=draw(st.integers(0, 1) if late else st.integers(1, 3)) if priority else 0,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        logit_bias=bias,
        # (no riding wave and no prefix hit for its prompt; it changes no token)
        prompt_logprobs=draw(st.sampled_from([None, None, None, 2])),
    )


# (presence, frequency, repetition, logit bias): mostly none, so that requests with and
# without them share batches, slots and snapshots
LOGIT_EDITS = [
    (0.0, 0.0, 1.0, {}),
    (0.0, 0.0, 1.0, {}),
    (0.0, 0.0, 1.0, {}),
    (1.0, 1.5, 1.4, {}),
    (-2.0, 0.0, 0.7, {5: 2.0, 300: -1.0}),
    (0.0, 0.0, 1.0, {t: 1.0 for t in range(3, 303, 7)}),
]


ABORTS = st.one_of(
    st.none(),
    st.builds(Abort, st.just("running"), st.integers(0, 4)),
    st.none(),
    st.builds(Abort, st.just("step"), st.integers(0, 12)),
    st.none(),
)


@st.composite
def pool_columns(draw: st.DrawFn, specs: list[Spec], block_size: int) -> int:
    """Blocks per plane for incremental KV: mostly room for the prompts of the first two
    requests (both arrive at step 0) but, whichever of them finishes first, not for it at full
    length next to the other's prompt, so their growth must preempt; else as `tight_pool`."""
    full = [cdiv(s.positions, block_size) for s in specs]
    prompt = [cdiv(len(s.prompt), block_size) for s in specs]
    lo = max(max(full), prompt[0] + prompt[1])
    hi = min(full[0] + prompt[1], full[1] + prompt[0]) - 1
    if lo <= hi and draw(st.integers(0, 3)) < 3:
        return lo + draw(st.integers(0, min(2, hi - lo)))
    return draw(tight_pool(specs, block_size))


@st.composite
def tight_pool(draw: st.DrawFn, specs: list[Spec], block_size: int) -> int:
    """Blocks per plane: about the largest request at full length; sometimes too small for it
    (rejected)."""
    full = max(cdiv(s.positions, block_size) for s in specs)
    return max(1, full + draw(st.sampled_from([0, 1, 0, 2, -1, 0])))


@st.composite
def workloads(draw: st.DrawFn, axes: Axes, mode: tuple[str, bool, bool]) -> Workload:
    """A workload under one of MODES. Hypothesis favours the first entry of a `sampled_from`
    (and the first branch of a `one_of`) when it simplifies, so the hard paths come first."""
    layout, incremental, preemption = mode
    planes = 1 if layout == "shared" else DEPTH
    block_size = draw(st.sampled_from(axes.block_sizes))
    policy = draw(st.sampled_from(["priority", "fcfs", "priority"]))
    specs: list[Spec] = []
    for i in range(draw(st.integers(3, axes.max_requests))):
        prompt, source = draw(prompts(block_size, [s.prompt for s in specs]))
        # two at step 0, then arrivals at drawn steps or once an earlier request is done
        # (often the one whose prompt this one extends: its prefix is cached by then)
        arrive = draw(st.one_of(st.integers(1, 8), st.just(0), st.integers(1, 40))) if i >= 2 else 0
        after = None
        if i >= 2:
            follow = st.just(source) if source is not None else st.none()
            after = draw(st.one_of(st.none(), follow, st.none(), st.none(), st.integers(0, i - 1)))
        late = arrive > 0 or after is not None
        params = draw(sampling(axes.sampled, policy == "priority", late))
        # the first two are the pressure pair (see pool_columns): aborted less often
        abort = draw(ABORTS if i >= 2 else st.one_of(st.none(), ABORTS, st.none()))
        specs.append(Spec(prompt, params, arrive, after, abort))
    watermark = draw(st.sampled_from([0.0, 0.01, 0.2, 0.0])) if axes.memory_knobs else 0.01
    if incremental:
        columns = draw(pool_columns(specs, block_size))
        # admission keeps `watermark` of the pool free while something runs
        while int(watermark * planes * columns) > planes * columns - planes * (
            cdiv(len(specs[0].prompt), block_size) + cdiv(len(specs[1].prompt), block_size)
        ):
            columns += 1
    else:
        columns = draw(tight_pool(specs, block_size))
    max_num_seqs = draw(st.sampled_from((2, *range(3, axes.max_num_seqs + 1), 2, 1)))
    options: dict[str, Any] = dict(
        kv_layout=layout,
        block_size=block_size,
        num_blocks=planes * columns,
        incremental_kv=incremental,
        enable_preemption=preemption,
        enable_prefix_caching=layout == "last_exited" and draw(st.sampled_from([1, 0, 1])) == 1,
        scheduling_policy=policy,
        refill=draw(st.sampled_from([True, False, True, True])),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, max_num_seqs + 16)),
        prefill_chunk_size=draw(st.integers(1, 16)),
    )
    if axes.memory_knobs:
        options["watermark"] = watermark
        options["max_bypass"] = draw(st.integers(1, 4))
    swapped_aborts: tuple[int, ...] = ()
    if preemption:
        n = draw(st.sampled_from([0, 1, 1, 2]))
        ks = st.lists(st.integers(1, 3), min_size=n, max_size=n, unique=True)
        swapped_aborts = tuple(sorted(draw(ks)))
    return Workload(options, specs, swapped_aborts)


# ------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------


@dataclass
class Run:
    finals: dict[str, Any] = field(default_factory=dict)  # rid -> finished RequestOutput
    aborted: dict[str, Any] = field(default_factory=dict)  # rid -> RequestOutput of the abort
    rejected: set[str] = field(default_factory=set)
    fired: set[str] = field(default_factory=set)
    concurrent: set[tuple[str, str]] = field(default_factory=set)  # seen running together
    grown: set[str] = field(default_factory=set)  # seen holding more blocks than its prompt's
    guaranteed: set[str] = field(default_factory=set)  # mechanisms the draw guaranteed
    first_running: set[str] = field(default_factory=set)  # running after the first step
    steps: int = 0


def rid_of(i: int) -> str:
    return f"r{i}"


def run_workload(llm: LLM, w: Workload, check_step=None) -> Run:
    """Drive the workload through `llm` step by step; record the outputs and what fired.
    Ends with every request done and checks that nothing is left in the engine."""
    engine, options = llm.engine, w.options
    sched, blocks = engine.scheduler, engine.blocks
    planes = 1 if options["kv_layout"] == "shared" else DEPTH
    bs = options["block_size"]
    run = Run()
    added: dict[str, int] = {}  # rid -> step before which it was added
    order: dict[str, int] = {}  # rid -> arrival order
    tokens: Counter[str] = Counter()  # rid -> output tokens so far
    swapped_boundaries = 0

    def done(rid: str) -> bool:
        return rid in run.finals or rid in run.aborted or rid in run.rejected

    def abort(rid: str, where: str) -> None:
        run.fired.add(where)
        out = engine.abort_request(rid)
        assert out is not None and out.finish_reason == "abort" and out.finished, rid
        run.aborted[rid] = out

    step = 0
    while len(added) + len(run.rejected) < len(w.specs) or engine.has_unfinished_requests():
        assert step < MAX_STEPS, "the engine did not terminate"
        for i, s in enumerate(w.specs):
            rid = rid_of(i)
            if rid in added or rid in run.rejected or step < s.arrive:
                continue
            if s.after is not None and not done(rid_of(s.after)):
                continue
            if planes * cdiv(s.positions, bs) > options["num_blocks"]:
                with pytest.raises(ValueError, match="KV blocks"):
                    engine.add_request(list(s.prompt), s.params, request_id=rid)
                run.rejected.add(rid)
            else:
                engine.add_request(list(s.prompt), s.params, request_id=rid)
                added[rid], order[rid] = step, len(order)
        running = {r.request_id for r in sched.running}
        if sched.swapped:
            swapped_boundaries += 1
            if swapped_boundaries in w.swapped_aborts:
                abort(sched.swapped[0].request_id, "abort_swapped")
        for i, s in enumerate(w.specs):
            rid, a = rid_of(i), s.abort
            if a is None or rid not in added or done(rid):
                continue
            if (a.kind == "step" and step - added[rid] >= a.at) or (
                a.kind == "running" and rid in running and tokens[rid] >= a.at
            ):
                swapped = any(r.request_id == rid for r in sched.swapped)
                where = "running" if rid in running else "swapped" if swapped else "waiting"
                abort(rid, f"abort_{where}")
        queued = {r.request_id: r.params.priority for r in (*sched.waiting, *sched.swapped)}
        waiting = {r.request_id for r in sched.waiting}
        running = {r.request_id: r.params.priority for r in sched.running}
        for out in engine.step():
            tokens[out.request_id] = out.num_tokens
            if out.finished:
                assert not done(out.request_id), out.request_id
                run.finals[out.request_id] = out
        running_now = [r.request_id for r in sched.running]
        if step == 0:
            run.first_running = set(running_now)
        run.concurrent |= {(a, b) for a in running_now for b in running_now if a < b}
        for r in sched.running if options["incremental_kv"] else ():
            if len(blocks.owned_blocks(r.request_id)[0]) > cdiv(r.prompt_len, bs):
                run.grown.add(r.request_id)
        if options["scheduling_policy"] == "priority":
            _observe_priority(run, order, queued, waiting, running, sched)
        if check_step is not None:
            check_step(llm, options)
        step += 1
    run.steps = step
    stats = engine.cache_stats()
    if stats["preemptions"] > 0:
        run.fired.add("preemption")
    if stats["prefix_hit_blocks"] > 0:
        run.fired.add("prefix_hit")
    if run.grown:
        run.fired.add("incremental_growth")
    if options["kv_layout"] == "shared":
        run.fired.add("shared")
    assert blocks.num_used == 0, "KV blocks leaked"
    assert not engine.has_unfinished_requests()
    assert not (sched.waiting or sched.running or sched.swapped)
    return run


def _observe_priority(run: Run, order, queued, waiting, running, sched) -> None:
    """Priority at work, seen from outside across one step: a request left the waiting queue
    while one that arrived earlier with a larger priority value stayed (overtake), or a
    running request was preempted while one with a smaller value came in (priority preemption).
    """
    waiting_now = {r.request_id for r in sched.waiting}
    queued_now = waiting_now | {r.request_id for r in sched.swapped}
    running_now = {r.request_id for r in sched.running}
    for rid in waiting - waiting_now:
        if any(order[o] < order[rid] and queued[o] > queued[rid] for o in waiting & waiting_now):
            run.fired.add("priority_overtake")
    came_in = [queued[rid] for rid in running_now if rid in queued]
    for rid, prio in running.items():
        if rid in queued_now and any(p < prio for p in came_in):
            run.fired.add("priority_preempt")


def check_async_equals_sync(
    ckpt: Path, w: Workload, sync: Run, sampled_ref=None, extra_check=None
) -> Run:
    """The same workload with asynchronous scheduling (the host plans a window ahead of what it
    has seen): it terminates, leaks nothing, matches the oracle, and every request that
    completed in both runs got exactly the same tokens and exit depths (aborts and arrivals
    keyed to token counts may land elsewhere, since the host sees tokens a window late)."""
    options = {**w.options, "async_scheduling": True}
    llm = LLM(str(ckpt), dtype="float32", device="cpu", **options)
    assert llm.engine.async_scheduling
    run = run_workload(llm, Workload(options, w.specs, w.swapped_aborts), check_step_invariants)
    if extra_check is not None:
        extra_check(llm)
    check_outputs(ckpt, Workload(options, w.specs, w.swapped_aborts), run, sampled_ref)
    for rid in sync.finals.keys() & run.finals.keys():
        a, b = sync.finals[rid], run.finals[rid]
        assert (a.token_ids, a.exit_depths) == (b.token_ids, b.exit_depths), rid
    return run


def check_step_invariants(llm: LLM, options: dict[str, Any]) -> None:
    engine = llm.engine
    sched, blocks = engine.scheduler, engine.blocks
    running = sched.running
    assert len(running) <= options["max_num_seqs"]
    held = {b for r in running for t in blocks.owned_blocks(r.request_id) for b in t}
    assert len(held) == blocks.num_used <= blocks.num_blocks
    if not (options["incremental_kv"] or options["enable_prefix_caching"]):
        assert blocks.num_used == sum(blocks.blocks_needed(r.max_positions) for r in running)
    for r in sched.swapped:
        assert blocks.owned_blocks(r.request_id) == []


# ------------------------------------------------------------------------------------------
# Which mechanisms must have fired
# ------------------------------------------------------------------------------------------


def enabled_mechanisms(w: Workload) -> set[str]:
    """The mechanisms an example's options (and drawn aborts) make possible."""
    options = w.options
    on = {"examples", "shared"}  # SHARED: counted over all examples
    any_abort = bool(w.swapped_aborts) or any(s.abort is not None for s in w.specs)
    if options["enable_preemption"] and (
        options["incremental_kv"] or options["scheduling_policy"] == "priority"
    ):
        on.add("preemption")  # growth or priority can preempt
    if options["enable_prefix_caching"]:
        on.add("prefix_hit")
    if any_abort:
        on.add("abort_running")
    if any_abort and "preemption" in on:
        on.add("abort_swapped")
    if options["scheduling_policy"] == "priority":
        on.add("priority_overtake")
        if options["enable_preemption"]:
            on.add("priority_preempt")
    if options["incremental_kv"]:
        on.add("incremental_growth")
    return on


def check_guaranteed_mechanisms(w: Workload, run: Run) -> None:
    """Per example: where the draw guarantees that a mechanism fires, it must have fired
    (recorded in `run.guaranteed`)."""
    options, bs = w.options, w.options["block_size"]
    columns = options["num_blocks"] // (1 if options["kv_layout"] == "shared" else DEPTH)
    completed = {rid_of(i): s for i, s in enumerate(w.specs) if rid_of(i) in run.finals}
    # (Incremental growth has no per-example guarantee: one step may run a decode window of
    # several tokens, so a request can grow and finish between two step boundaries. The
    # tally checks it across examples.)
    if options["incremental_kv"] and options["enable_preemption"]:
        # Two requests seen running together that both complete, where whichever finishes
        # first (holding its full length) and the other's prompt blocks exceed the pool:
        # impossible without a preemption in between, unless they share cached blocks.
        for a, b in run.concurrent:
            if a in completed and b in completed:
                sa, sb = completed[a], completed[b]
                # (admitted by the first step, when nothing is cached yet, they share nothing)
                first = a in run.first_running and b in run.first_running
                if options["enable_prefix_caching"] and common_prefix(sa, sb) >= bs and not first:
                    continue
                if (
                    cdiv(sa.positions, bs) + cdiv(len(sb.prompt), bs) > columns
                    and cdiv(sb.positions, bs) + cdiv(len(sa.prompt), bs) > columns
                ):
                    run.guaranteed.add("preemption")
                    assert "preemption" in run.fired, f"{a} and {b} ran together unpreempted"


def common_prefix(a: Spec, b: Spec) -> int:
    n = min(len(a.prompt), len(b.prompt))
    return next((k for k in range(n) if a.prompt[k] != b.prompt[k]), n)


class Tally:
    """Per property test: in how many examples each mechanism was enabled and fired."""

    KEYS = (
        "examples",
        "preemption",
        "prefix_hit",
        "abort_running",
        "abort_swapped",
        "priority_overtake",
        "priority_preempt",
        "incremental_growth",
        "shared",
    )

    def __init__(self) -> None:
        self.enabled: Counter[str] = Counter()
        self.fired: Counter[str] = Counter()
        self.guaranteed: Counter[str] = Counter()

    def add(self, w: Workload, run: Run) -> None:
        on = enabled_mechanisms(w)
        self.enabled.update(on)
        self.fired.update((run.fired | {"examples"}) & on)
        self.guaranteed.update(run.guaranteed)

    def table(self) -> str:
        rows = [
            f"{k:20s} fired {self.fired[k]:4d} / enabled {self.enabled[k]:4d}"
            + (f"  (guaranteed and asserted in {self.guaranteed[k]})" if self.guaranteed[k] else "")
            for k in self.KEYS
        ]
        return "\n".join(rows)

    def check(self, min_share: dict[str, float]) -> None:
        """Each mechanism fired in at least `min_share` of the examples that enabled it."""
        if not self.enabled["examples"]:
            pytest.skip("the property test did not run in this session")
        print(self.table())
        for key, share in min_share.items():
            assert self.enabled[key] > 0, f"no example enabled {key}\n{self.table()}"
            got = self.fired[key] / self.enabled[key]
            assert got >= share, f"{key} fired in {got:.0%} < {share:.0%}\n{self.table()}"


# ------------------------------------------------------------------------------------------
# Oracles
# ------------------------------------------------------------------------------------------


@functools.cache
def _weights(ckpt: str) -> tuple[dict, Any]:
    return load_file(str(Path(ckpt) / "model.safetensors")), load_config(ckpt)


_ORACLE: dict[tuple, tuple[list[int], list[int]]] = {}


def oracle(ckpt: Path, layout: str, prompt: tuple[int, ...], p: SamplingParams, n: int):
    """Dense fp32 greedy output (token ids, exit depths) of the first `n` tokens, read from the
    checkpoint file itself; memoised across examples (a longer run answers shorter ones)."""
    edits = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias)
    edits += (p.min_tokens, p.stop_token_ids)
    key = (str(ckpt), layout, prompt, p.min_loops, p.max_loops, p.exit_threshold, edits)
    have = _ORACLE.get(key)
    if have is None or len(have[0]) < n:
        sd, cfg = _weights(str(ckpt))
        fn = shared_greedy if layout == "shared" else reference_greedy
        kw = dict(
            min_loops=p.min_loops,
            max_loops=p.max_loops,
            exit_threshold=p.exit_threshold,
            edits=p,
        )
        have = _ORACLE[key] = fn(sd, cfg, list(prompt), n, **kw)
    return have[0][:n], have[1][:n]


def check_outputs(ckpt: Path, w: Workload, run: Run, sampled_ref=None) -> None:
    """Every completed request equals the dense oracle (greedy) or `sampled_ref` (seeded
    sampling); an aborted request's partial output is a prefix of that."""
    layout = w.options["kv_layout"]
    for i, s in enumerate(w.specs):
        rid = rid_of(i)
        if rid in run.rejected:
            assert rid not in run.finals and rid not in run.aborted
            continue
        if rid in run.aborted:
            assert rid not in run.finals
            out = run.aborted[rid]
            n = len(out.token_ids)
            if n and s.params.temperature == 0.0:
                want = oracle(ckpt, layout, s.prompt, s.params, n)
            elif n:
                tokens, depths = sampled_ref(layout, s.prompt, s.params)
                want = tokens[:n], depths[:n]
            if n:
                assert (out.token_ids, out.exit_depths) == want, f"aborted {rid}"
            continue
        out = run.finals[rid]
        assert out.finish_reason == "length", rid
        assert list(out.prompt_token_ids) == list(s.prompt)
        if s.params.prompt_logprobs is not None:  # every prompt token scored, in order
            assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
            assert [lp.token_id for lp in out.prompt_logprobs[1:]] == list(s.prompt)[1:], rid
        if s.params.temperature == 0.0:
            want = oracle(ckpt, layout, s.prompt, s.params, s.params.max_tokens)
        else:
            want = sampled_ref(layout, s.prompt, s.params)
        assert (out.token_ids, out.exit_depths) == want, rid
