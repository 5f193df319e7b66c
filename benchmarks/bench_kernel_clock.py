"""What a decode attention launch spends its time on, from clocks inside the kernel (GPU only).

    PYTHONPATH=. python benchmarks/bench_kernel_clock.py --out $OUT

A chain of Ouro-1.4B decode layers (`--model nanbeige`: Nanbeige4.2-3B's, GQA; bf16, `rows`
sequences at `keys` keys, each layer its own weights: norm -> qkv GEMM -> RoPE + K/V write ->
attention -> o_proj -> add + norm -> gate/up + SwiGLU -> down -> add + norm, the GEMMs as the
committed table runs them, PDL on; both models with Ouro's two norms a sublayer), captured in
a CUDA graph and replayed. The attention launches of the chain carry a probe
(`paged_attention._launch(probe=...)`): each program stamps the global ns timer and its SM's
cycle counter at its start, after its PDL wait and at its end. Per layer and replay:

- early: the first program's start before the first wait return (how early PDL placed the
  launch), wait_spread: the spread of the programs' wait returns (when the launch before and
  its memory were done, as each program saw it), own: each program's wait -> end (the work
  after its wait, ns and SM cycles), end_after_last_wait: the launch's last end after its last
  wait return, gap: this launch's first wait return after the previous attention's last
  end (the layer's kernels between them), and layer: this launch's last end after the
  previous attention's (a whole layer, a split-K merge launch included);
- a program's own time by phases (paged_attention.PROBE_FIELDS' data-dependent stamps):
  metadata (its wait to its sequence's metadata landed; one sequence's tensor-core walk,
  which reads that before the wait (EARLY_KEYS): to q and its first key tile's K/V landed),
  first_tile (to its first key tile's P @ V done), other_tiles (to its last tile's), store
  (to its end: the output, a merge). Each data-dependent stamp waits for a reduction of what
  it follows: other_tiles of a one-tile walk read 0.5 us on an H100
  (results/2026-12-07-l2-tail-and-release-h100.md). So the stamps change what they time,
  and by more in one attention form than in another: compare two forms end to end
  (ab_decode.py), not by this clock, which ordered three pairs of them the wrong way
  (results/2026-12-07-wide-tile-two-seqs-h100.md). Each run also replays the same chain
  without any stamp: layer_us_unprobed (and layer_us_replayed, the stamped chain timed the
  same way: CUDA events around a replay, median, per layer) says what the stamps cost and is
  the number two forms compare by here.

Reported as medians over layers and replays, at 1 and 8 rows (`--rows`).

--timeline: the chain's warp-specialised GEMMs (those of qkv, o_proj, gate/up + SwiGLU and
down_proj the table runs on the ws kernel; the others stay off the time line, and the qkv must
be one) carry probes too (`ws_gemm(..., probe=...)`, its PROBE_FIELDS), and each kernel of a
layer is placed on one time line whose zero is the layer's qkv wait return: when its first
program started (placed under PDL), when its median program was placed (its producer warp's
start), when its producers' first ring of weight tiles had landed (median over programs), when
its waits returned (median), its activation rows landed, its last MMA retired, and its last
program ended. What it answers: how full each GEMM's ring is when its wait returns, what a GEMM
does between its wait and its end, and where in the layer the weight stream stops.

--qkv-rope: RoPE + the K/V write in the qkv GEMM's epilogue (`ws_gemm(..., rope=QkvRope)`,
what the engine's decode runs), not in their own launch.

--unreduced: the o_proj's and down_proj's split-K partials summed by the add + norm launch
(`ws_gemm(..., unreduced=True)`, kernels/split_sums; what the engine's decode runs), not by
the GEMM's last split.

--timeline also places the layer's two add + norms (kernels/norm_chain's probe): their first
and median program start, median wait return, median x computed (the row's partials and
residual landed: the probe's "loaded") and last end; and reports qkv_to_qkv (a whole layer,
from one qkv's median wait return to the next's).

--engine-attention: decode attention as the engine launches it (`decode_splits`' splits
merged by the last split, the kernel `_launch` picks: at 8 Ouro rows the one-warp rows kernel
split 16 ways), not the tensor-core kernel unsplit. It carries the probe too; only the
programs that pass their wait stamp it (a split without keys leaves before it), so the
stamps and the time line are those of the programs with keys.

--set module.NAME=VALUE: an rlt_engine module constant set first, as in ab_decode.py (e.g.
kernels.ws_gemm.X_BY_LOADS_ROWS=0: the rows by TMA); --row KEY=ROW: a row of the small-GEMM
table this GPU takes replaced first, as in ab_decode.py (e.g. Nanbeige's gate/up on the ws
SwiGLU form, to see when the down_proj's ring fills under it).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from rlt_engine.kernels.gate_up_swiglu import gate_up_silu  # noqa: E402
from rlt_engine.kernels.norm import rms_norm  # noqa: E402
from rlt_engine.kernels.norm_chain import PROBE_FIELDS as NORM_FIELDS  # noqa: E402
from rlt_engine.kernels.norm_chain import add_rms_norm  # noqa: E402
from rlt_engine.kernels.paged_attention import PROBE_FIELDS as ATTENTION_FIELDS  # noqa: E402
from rlt_engine.kernels.paged_attention import _launch, _rows_wins, decode_splits  # noqa: E402
from rlt_engine.kernels.rope_kv_write import rope_write_kv_  # noqa: E402
from rlt_engine.kernels.small_gemm import choose, linear, linear_rope  # noqa: E402
from rlt_engine.kernels.ws_gemm import PROBE_FIELDS, QkvRope, ws_gemm  # noqa: E402

BLOCK = 16  # keys a K/V block


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    inter: int
    d: int = 128


MODELS = {"ouro": Dims(2048, 16, 16, 5632), "nanbeige": Dims(3072, 48, 8, 10752)}


GEMMS = ("qkv", "o", "gate_up", "down")
NORMS = ("norm_o", "norm_down")


class Chain:
    def __init__(
        self,
        rows: int,
        keys: int,
        layers: int,
        tiles: dict | None = None,
        gemms: bool = False,
        qkv_rope: bool = False,
        unreduced: bool = False,
        dims: Dims = MODELS["ouro"],
        engine_attention: bool = False,
    ) -> None:
        g = torch.Generator(device="cuda").manual_seed(0)

        def rnd(*shape, scale=1.0):
            return (torch.randn(shape, device="cuda", generator=g) * scale).bfloat16()

        self.rows, self.keys, self.tiles, self.dims = rows, keys, dict(tiles or {}), dims
        heads, kv_heads, D, inter = dims.heads, dims.kv_heads, dims.d, dims.inter
        # --engine-attention: decode attention as the engine launches it (its kernel and
        # splits for these rows, merged by the last split)
        self.engine_attention = engine_attention
        if engine_attention:
            self.split_counters = torch.zeros(rows * heads, dtype=torch.int32, device="cuda")
            self.splits = decode_splits(rows, False, mha=heads == kv_heads)
            rows_kernel = heads == kv_heads and _rows_wins(rows, heads, self.splits, False)
            programs = rows * (heads if rows_kernel else kv_heads) * self.splits
        else:  # the tensor-core kernel's programs: one per (sequence, KV head, split)
            programs = rows * kv_heads * self.tiles.get("num_splits", 1)
        if self.tiles.pop("merge", 0):  # split-K merged by the last split (no merge launch)
            self.tiles["split_counters"] = torch.zeros(
                rows * kv_heads, dtype=torch.int32, device="cuda"
            )
        h, d = dims.hidden, heads * D
        self.layers = [
            {
                "qkv": rnd((heads + 2 * kv_heads) * D, h, scale=h**-0.5),
                "o": rnd(h, d, scale=d**-0.5),
                "gate_up": rnd(2 * inter, h, scale=h**-0.5),
                "down": rnd(h, inter, scale=inter**-0.5),
                "norms": [1 + rnd(h, scale=0.1) for _ in range(4)],
                "pool": (rnd(rows * keys, kv_heads, D), rnd(rows * keys, kv_heads, D)),
                "probe": torch.full(
                    (programs, len(ATTENTION_FIELDS)), -1, dtype=torch.int64, device="cuda"
                ),
            }
            for _ in range(layers)
        ]
        self.qkv_rope, self.unreduced = qkv_rope, unreduced
        self.x = rnd(rows, h)
        # --timeline: one probe per launch of each GEMM the table runs on the ws kernel, sized
        # by its config for these rows (every layer's weights have the first layer's shapes)
        first, configs = self.layers[0], {}
        if gemms:
            configs = {
                n: choose(self.x.new_empty(rows, first[n].shape[1]), first[n]) for n in GEMMS
            }
        self.ws_configs = {n: c for n, c in configs.items() if c is not None and c.kernel == "ws"}
        self.probed = tuple(self.ws_configs)
        if gemms and "qkv" not in self.probed:
            raise SystemExit("--timeline: the table runs no ws kernel for the qkv (the zero)")
        for layer in self.layers:
            for name, config in self.ws_configs.items():
                programs = layer[name].shape[0] // config.block_n  # SwiGLU: half of each a program
                layer[f"{name}_probe"] = torch.full(
                    (programs * config.split_k, len(PROBE_FIELDS)), -1,
                    dtype=torch.int64, device="cuda",
                )  # fmt: skip
            if gemms:  # the two add + norms of the layer, after the o_proj and the down_proj
                for name in NORMS:
                    layer[f"{name}_probe"] = torch.full(
                        (rows, len(NORM_FIELDS)), -1, dtype=torch.int64, device="cuda"
                    )
        blocks = keys // BLOCK
        self.tables = torch.arange(rows * blocks, dtype=torch.int32, device="cuda").view(rows, -1)
        self.seq_lens = torch.full((rows,), keys, dtype=torch.int32, device="cuda")
        self.query_start = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
        self.slots = torch.arange(rows, device="cuda") * keys + keys - 1
        angles = rnd(rows, dims.d).float()
        self.cos, self.sin = angles.cos().bfloat16(), angles.sin().bfloat16()

    def gemm(
        self, layer: dict, name: str, x: torch.Tensor, rope=None, probes: bool = True, **kw
    ) -> torch.Tensor:
        if name not in self.probed or not probes:  # the engine's route (the table's config)
            if name == "gate_up":
                return gate_up_silu(x, layer[name])
            if rope is not None:
                out = linear_rope(x, layer[name], rope)
                if out is None:
                    raise SystemExit("--qkv-rope: the table runs no ws kernel for the qkv")
                return out
            return linear(x, layer[name], unreduced=self.unreduced and name != "qkv", **kw)
        return ws_gemm(x, layer[name], self.ws_configs[name], swiglu=name == "gate_up",
                       probe=layer[f"{name}_probe"], rope=rope,
                       unreduced=self.unreduced and name in ("o", "down"))  # fmt: skip

    def run(self, probes: bool = True) -> torch.Tensor:
        """The chain's launches; `probes` False: none stamps (the engine's launches as they
        run in decode, for the unprobed replay time)."""
        x = self.x
        heads, kv_heads, D = self.dims.heads, self.dims.kv_heads, self.dims.d
        h = rms_norm(x, self.layers[0]["norms"][0], 1e-6)
        for layer in self.layers:
            k_pool, v_pool = layer["pool"]
            rope = QkvRope(self.cos, self.sin, k_pool, v_pool, self.slots, heads)
            probe = layer["probe"] if probes else None
            norm_probes = [layer.get(f"{n}_probe") if probes else None for n in NORMS]
            qkv = self.gemm(layer, "qkv", h, rope=rope if self.qkv_rope else None, probes=probes)
            qkv = qkv.view(self.rows, heads + 2 * kv_heads, D)
            q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
            v = qkv[:, heads + kv_heads :]
            if not self.qkv_rope:
                rope_write_kv_(q, k, v, self.cos, self.sin, k_pool, v_pool, self.slots)
            if self.engine_attention:
                attn = _launch(
                    q, k_pool, v_pool, self.tables, self.seq_lens, self.query_start, BLOCK,
                    D**-0.5, 1, num_splits=self.splits, prefetch_kv=True,
                    split_counters=self.split_counters, probe=probe,
                )  # fmt: skip
            else:
                attn = _launch(
                    q, k_pool, v_pool, self.tables, self.seq_lens, self.query_start, BLOCK,
                    D**-0.5, 1, kernel="mma", prefetch_kv=True, probe=probe, **self.tiles,
                )  # fmt: skip
            attn = attn.reshape(self.rows, heads * D)
            o = self.gemm(layer, "o", attn, probes=probes, prefetch_whole=True)
            # (o and down are SplitSums with --unreduced: the add + norm sums them)
            n1, n2, n3, n4 = layer["norms"]
            x, h = add_rms_norm(o, x, n2, 1e-6, y_weight=n1, probe=norm_probes[0])
            act = self.gemm(layer, "gate_up", h, probes=probes)
            down = self.gemm(layer, "down", act, probes=probes)
            x, h = add_rms_norm(down, x, n4, 1e-6, y_weight=n3, probe=norm_probes[1])
        return h


def layer_timeline(layer: dict, probed: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """One layer's kernels on one time line (us), zero at the qkv GEMM's median wait return:
    per kernel its first start, median ring-full (GEMMs), median wait return, median
    activation rows landed and last MMA (GEMMs), last end; attention's first and median
    start, median wait return and last key tile done, and last end, over the programs that
    stamped (those with keys); the two add + norms' first start, median start, wait return and
    loads landed, and last end. The GEMMs of `probed` only (those on the ws kernel); attention
    only if it carries a probe. Probes read back to the host."""
    marks: dict[str, dict[str, float]] = {}
    fields = {f: i for i, f in enumerate(PROBE_FIELDS)}
    for name in probed:
        p = layer[f"{name}_probe"].cpu().double()
        marks[name] = {
            "start": float(p[:, [fields["start"], fields["producer_start"]]].min()),
            "placed": float(p[:, fields["producer_start"]].median()),
            "ring_full": float(p[:, fields["ring_full"]].median()),
            "waited": float(p[:, fields["waited"]].median()),
            "x_ready": float(p[:, fields["x_ready"]].median()),
            "mma_done": float(p[:, fields["mma_done"]].median()),
            "end": float(p[:, fields["end"]].max()),
        }
    a = stamped(layer["probe"]).double() if "probe" in layer else None
    if a is not None and len(a):  # attention: start, waited, end (ns), then cycles, phases
        marks["attention"] = {
            "start": float(a[:, 0].min()),
            "placed": float(a[:, 0].median()),
            "waited": float(a[:, 1].median()),
            "keys_done": float(a[:, ATTENTION_FIELDS.index("keys_done")].median()),
            "end": float(a[:, 2].max()),
        }
    nf = {f: i for i, f in enumerate(NORM_FIELDS)}
    for name in NORMS:
        if f"{name}_probe" in layer:
            p = layer[f"{name}_probe"].cpu().double()
            marks[name] = {
                "start": float(p[:, nf["start"]].min()),
                "placed": float(p[:, nf["start"]].median()),
                "waited": float(p[:, nf["waited"]].median()),
                "loaded": float(p[:, nf["loaded"]].median()),
                "end": float(p[:, nf["end"]].max()),
            }
    zero = qkv_wait_ns(layer)
    order = ("qkv", "attention", "o", "norm_o", "gate_up", "down", "norm_down")
    return {k: {f: (t - zero) / 1e3 for f, t in marks[k].items()} for k in order if k in marks}


def stamped(probe: torch.Tensor) -> torch.Tensor:
    """An attention probe's rows (on the host) of the programs that stamped it: those that
    left before their wait or before any key (a split without keys, padding) keep -1."""
    p = probe.cpu()
    return p[p[:, 0] >= 0]


def qkv_wait_ns(layer: dict) -> float:
    """The layer's zero: its qkv GEMM's median wait return (ns, the global timer)."""
    return float(layer["qkv_probe"][:, PROBE_FIELDS.index("waited")].cpu().double().median())


# a program's time after its wait, by the phases its stamps mark (us, per program)
PHASES = ("metadata", "first_tile", "other_tiles", "store")


def attention_phases(probe: torch.Tensor) -> dict[str, list[float]]:
    """Per program (those that ran: padding programs leave -1): its wait to its metadata
    landed, to its first key tile done, to its last, and to its end (the store, a merge)."""
    f = {name: i for i, name in enumerate(ATTENTION_FIELDS)}
    p = probe[probe[:, f["keys_done"]] >= 0].double()
    marks = [f["waited"], f["metadata"], f["first_tile"], f["keys_done"], f["end"]]
    return {
        phase: ((p[:, b] - p[:, a]) / 1e3).tolist()
        for phase, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True)
    }


def measure(
    rows: int,
    keys: int,
    layers: int,
    replays: int,
    tiles: dict | None = None,
    timeline: bool = False,
    qkv_rope: bool = False,
    unreduced: bool = False,
    dims: Dims = MODELS["ouro"],
    engine_attention: bool = False,
) -> dict:
    chain = Chain(rows, keys, layers, tiles, timeline, qkv_rope, unreduced, dims, engine_attention)
    graph = capture(chain.run)
    plain = capture(lambda: chain.run(probes=False))  # no stamps: what they cost and change
    keys_ = ("early", "wait_spread", "own", "own_cycles", "end_after_last_wait", "gap", "layer")
    keys_ += (*PHASES, "qkv_to_qkv")
    stats: dict[str, list[float]] = {k: [] for k in keys_}
    lines: list[dict] = []
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        previous_end = previous_qkv = None
        for i, layer in enumerate(chain.layers):
            if timeline and i > 0:  # the first layer starts after a plain norm, not a down_proj
                lines.append(layer_timeline(layer, chain.probed))
                zero = qkv_wait_ns(layer)
                if previous_qkv is not None:  # a whole layer, qkv wait to qkv wait
                    stats["qkv_to_qkv"].append((zero - previous_qkv) / 1e3)
                previous_qkv = zero
            p = stamped(layer["probe"])
            start, waited, end = p[:, 0], p[:, 1], p[:, 2]
            stats["early"].append(float(waited.min() - start.min()) / 1e3)
            if previous_end is not None:
                stats["gap"].append(float(waited.min() - previous_end) / 1e3)
                stats["layer"].append(float(end.max() - previous_end) / 1e3)
            stats["wait_spread"].append(float(waited.max() - waited.min()) / 1e3)
            stats["own"] += ((end - waited).double() / 1e3).tolist()
            stats["own_cycles"] += (p[:, 5] - p[:, 4]).double().tolist()
            for phase, us in attention_phases(p).items():
                stats[phase] += us
            stats["end_after_last_wait"].append(float(end.max() - waited.max()) / 1e3)
            previous_end = int(end.max())
    medians = {
        (f"{k}_median" if k == "own_cycles" else f"{k}_us_median"): (statistics.median(v))
        for k, v in stats.items()
        if v
    }
    # the whole chain's replay, with and without the stamps, per layer (the first layer's plain
    # norm included): two forms compare by the unprobed time, never by the stamps
    medians["layer_us_replayed"] = replay_us(graph, replays) / layers
    medians["layer_us_unprobed"] = replay_us(plain, replays) / layers
    # the attention launch's programs, and those that stamped (passed their wait with keys)
    programs, ran = len(chain.layers[0]["probe"]), len(stamped(chain.layers[-1]["probe"]))
    out = {"rows": rows, "keys": keys, "programs": programs, "programs_stamped": ran}
    out |= {**(tiles or {}), **medians}
    if stats["own"]:
        out["own_us_max"] = max(stats["own"])
    if engine_attention:
        out["attention"] = "engine"
    if timeline:
        out["timeline_us"] = {
            k: {f: statistics.median(line[k][f] for line in lines) for f in lines[0][k]}
            for k in lines[0]
        }
    return out


def capture(body: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`body`'s launches warmed up twice on a side stream (compiles, autotuning), then
    captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """A captured CUDA graph's replay time (us, CUDA events), the median over `replays` after
    three not counted."""
    times = []
    for i in range(replays + 3):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(begin.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(fromfile_prefix_chars="@")  # @FILE: its lines, one argument each
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", choices=sorted(MODELS), default="ouro")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 8], help="sequences in decode")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--keys", type=int, nargs="*", default=[96])
    ap.add_argument(
        "--tiles", nargs="*", default=[""],
        help="attention launch overrides to compare, e.g. w4n64s1k2m1 (num_warps 4, block_n 64, "
        "num_stages 1, num_splits 2, merged in the kernel); '' for the launch's own choice",
    )  # fmt: skip
    ap.add_argument("--timeline", action="store_true", help="see the module docstring")
    ap.add_argument("--qkv-rope", action="store_true", help="see the module docstring")
    ap.add_argument("--unreduced", action="store_true", help="see the module docstring")
    ap.add_argument("--engine-attention", action="store_true", help="see the module docstring")
    ap.add_argument(
        "--set", dest="sets", action="append", default=[],
        help="module.NAME=VALUE of rlt_engine, as benchmarks/ab_decode.py takes it",
    )  # fmt: skip
    from ab_decode import apply_gpu_rows, apply_sets, parse_row, parse_set  # scripts beside this

    ap.add_argument(
        "--row", dest="table_rows", action="append", default=[], type=parse_row,
        metavar="KEY=ROW",
        help="a row of the small-GEMM table this GPU takes, as benchmarks/ab_decode.py takes it",
    )  # fmt: skip
    args = ap.parse_args()
    apply_sets([parse_set(text) for text in args.sets])
    apply_gpu_rows(args.table_rows)
    args.out.mkdir(parents=True, exist_ok=True)
    names = {"w": "num_warps", "n": "block_n", "s": "num_stages", "k": "num_splits", "m": "merge"}
    results = []
    for spec in args.tiles:
        tiles = {names[k]: int(v) for k, v in re.findall(r"([wnskm])(\d+)", spec)}
        for keys in args.keys:
            for rows in args.rows:
                results.append(
                    measure(
                        rows,
                        keys,
                        args.layers,
                        args.replays,
                        tiles,
                        args.timeline,
                        args.qkv_rope,
                        args.unreduced,
                        MODELS[args.model],
                        args.engine_attention,
                    )
                )
                print(json.dumps(results[-1]), flush=True)
    (args.out / "kernel_clock.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
