"""What a decode attention launch spends its time on, from clocks inside the kernel (GPU only).

    PYTHONPATH=. python benchmarks/bench_kernel_clock.py --out $OUT

A chain of Ouro-1.4B decode layers (bf16, `rows` sequences at `keys` keys, each layer its own
weights: norm -> qkv GEMM -> RoPE + K/V write -> attention -> o_proj -> add + norm -> gate/up +
SwiGLU -> down -> add + norm, the GEMMs as the committed table runs them, PDL on), captured in a
CUDA graph and replayed. The attention launches of the chain carry a probe
(`paged_attention._launch(probe=...)`): each program stamps the global ns timer and its SM's
cycle counter at its start, after its PDL wait and at its end. Per layer and replay:

- early: the first program's start before the first wait return (how early PDL placed the
  launch), wait_spread: the spread of the programs' wait returns (when the launch before and
  its memory were done, as each program saw it), own: each program's wait -> end (the work
  after its wait, ns and SM cycles), end_after_last_wait: the launch's last end after its last
  wait return, gap: this launch's first wait return after the previous attention's last
  end (the layer's kernels between them), and layer: this launch's last end after the
  previous attention's (a whole layer, a split-K merge launch included).

Reported as medians over layers and replays, at 1 and 8 rows.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from rlt_engine.kernels.gate_up_swiglu import gate_up_silu  # noqa: E402
from rlt_engine.kernels.norm import rms_norm  # noqa: E402
from rlt_engine.kernels.norm_chain import add_rms_norm  # noqa: E402
from rlt_engine.kernels.paged_attention import _launch  # noqa: E402
from rlt_engine.kernels.rope_kv_write import rope_write_kv_  # noqa: E402
from rlt_engine.kernels.small_gemm import linear  # noqa: E402

HIDDEN, HEADS, D, INTER, BLOCK = 2048, 16, 128, 5632, 16


class Chain:
    def __init__(self, rows: int, keys: int, layers: int, tiles: dict | None = None) -> None:
        g = torch.Generator(device="cuda").manual_seed(0)

        def rnd(*shape, scale=1.0):
            return (torch.randn(shape, device="cuda", generator=g) * scale).bfloat16()

        self.rows, self.keys, self.tiles = rows, keys, dict(tiles or {})
        if self.tiles.pop("merge", 0):  # split-K merged by the last split (no merge launch)
            self.tiles["split_counters"] = torch.zeros(
                rows * HEADS, dtype=torch.int32, device="cuda"
            )
        h, d = HIDDEN, HEADS * D
        self.layers = [
            {
                "qkv": rnd(3 * d, h, scale=h**-0.5),
                "o": rnd(h, d, scale=d**-0.5),
                "gate_up": rnd(2 * INTER, h, scale=h**-0.5),
                "down": rnd(h, INTER, scale=INTER**-0.5),
                "norms": [1 + rnd(h, scale=0.1) for _ in range(4)],
                "pool": (rnd(rows * keys, HEADS, D), rnd(rows * keys, HEADS, D)),
                "probe": torch.full(
                    (rows * HEADS * self.tiles.get("num_splits", 1), 6),
                    -1,
                    dtype=torch.int64,
                    device="cuda",
                ),
            }
            for _ in range(layers)
        ]
        self.x = rnd(rows, h)
        blocks = keys // BLOCK
        self.tables = torch.arange(rows * blocks, dtype=torch.int32, device="cuda").view(rows, -1)
        self.seq_lens = torch.full((rows,), keys, dtype=torch.int32, device="cuda")
        self.query_start = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
        self.slots = torch.arange(rows, device="cuda") * keys + keys - 1
        angles = rnd(rows, D).float()
        self.cos, self.sin = angles.cos().bfloat16(), angles.sin().bfloat16()

    def run(self) -> torch.Tensor:
        x = self.x
        h = rms_norm(x, self.layers[0]["norms"][0], 1e-6)
        for layer in self.layers:
            k_pool, v_pool = layer["pool"]
            qkv = linear(h, layer["qkv"]).view(self.rows, 3 * HEADS, D)
            q, k, v = qkv[:, :HEADS], qkv[:, HEADS : 2 * HEADS], qkv[:, 2 * HEADS :]
            rope_write_kv_(q, k, v, self.cos, self.sin, k_pool, v_pool, self.slots)
            attn = _launch(
                q, k_pool, v_pool, self.tables, self.seq_lens, self.query_start, BLOCK,
                D**-0.5, 1, kernel="mma", prefetch_kv=True, probe=layer["probe"], **self.tiles,
            )  # fmt: skip
            o = linear(attn.reshape(self.rows, HEADS * D), layer["o"], prefetch_whole=True)
            n1, n2, n3, n4 = layer["norms"]
            x, h = add_rms_norm(o, x, n2, 1e-6, y_weight=n1)
            act = gate_up_silu(h, layer["gate_up"])
            down = linear(act, layer["down"])
            x, h = add_rms_norm(down, x, n4, 1e-6, y_weight=n3)
        return h


def measure(rows: int, keys: int, layers: int, replays: int, tiles: dict | None = None) -> dict:
    chain = Chain(rows, keys, layers, tiles)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            chain.run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain.run()
    keys_ = ("early", "wait_spread", "own", "own_cycles", "end_after_last_wait", "gap", "layer")
    stats: dict[str, list[float]] = {k: [] for k in keys_}
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        previous_end = None
        for layer in chain.layers:
            p = layer["probe"].cpu()
            start, waited, end = p[:, 0], p[:, 1], p[:, 2]
            stats["early"].append(float(waited.min() - start.min()) / 1e3)
            if previous_end is not None:
                stats["gap"].append(float(waited.min() - previous_end) / 1e3)
                stats["layer"].append(float(end.max() - previous_end) / 1e3)
            stats["wait_spread"].append(float(waited.max() - waited.min()) / 1e3)
            stats["own"] += ((end - waited).double() / 1e3).tolist()
            stats["own_cycles"] += (p[:, 5] - p[:, 4]).double().tolist()
            stats["end_after_last_wait"].append(float(end.max() - waited.max()) / 1e3)
            previous_end = int(end.max())
    medians = {
        (f"{k}_median" if k == "own_cycles" else f"{k}_us_median"): (statistics.median(v))
        for k, v in stats.items()
        if v
    }
    return {"rows": rows, "keys": keys, "programs": rows * HEADS, **(tiles or {}), **medians,
            "own_us_max": max(stats["own"])}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--keys", type=int, nargs="*", default=[96])
    ap.add_argument(
        "--tiles", nargs="*", default=[""],
        help="attention launch overrides to compare, e.g. w4n64s1k2m1 (num_warps 4, block_n 64, "
        "num_stages 1, num_splits 2, merged in the kernel); '' for the launch's own choice",
    )  # fmt: skip
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = {"w": "num_warps", "n": "block_n", "s": "num_stages", "k": "num_splits", "m": "merge"}
    results = []
    for spec in args.tiles:
        tiles = {names[k]: int(v) for k, v in re.findall(r"([wnskm])(\d+)", spec)}
        for keys in args.keys:
            for rows in (1, 8):
                results.append(measure(rows, keys, args.layers, args.replays, tiles))
                print(json.dumps(results[-1]), flush=True)
    (args.out / "kernel_clock.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
