"""Where a decode traversal's time goes, in place: remove one kind of kernel from every layer and
see how much faster decode gets (GPU only; outputs are garbage in the ablated runs, the schedule
is not: fixed depth, ignore_eos).

    PYTHONPATH=.:tests python benchmarks/bench_layer_ablation.py --out $OUT [--parts ...]

Parts:
- ablate: committed decode tok/s of Ouro-1.4B dummy bf16 (64/32, fixed depth 4, CUDA graphs) at
  c = 1 and 8 with each kernel kind of the layer removed (its output replaced by an unwritten
  buffer of the right shape, no launch): the difference to the full layer is that kernel's cost
  in place, its overlap with its neighbours (PDL) included. Reported per layer and traversal.
- chains: CUDA graphs of 24 layers' weight GEMMs alone at M = 1 / 8 (each layer its own
  weights: 2.4 GB a replay, no L2 reuse), per GEMM kind and all four in a row, with and without
  PDL, in TB/s of weight bytes and as a share of a 2 GiB copy's read + written rate (the
  convention of bench_small_gemm.py; on the H200 this copy read 2.70 TB/s where
  bench_small_gemm's measured 4.24: compare with that); and a chain of 240 add + RMSNorm
  launches (the smallest kernel of the layer) for the cost of one dependent launch.
- tune: decode tok/s at c = 1 / 8 with one GEMM's config (or prefetch) changed, in place.
- variants: the full layer at c = 1 / 8 / 64 with the decode prefetches (K/V rows asked of L2
  before attention's PDL wait, the o_proj's whole weight during attention) undone one at a
  time, and both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_kernel_clock import capture, replay_us  # noqa: E402
from h200_decode import OURO, _engine, _median_rate  # noqa: E402

DEPTH, LAYERS = 4, 24
KINDS = ("qkv", "rope_kv", "attention", "o_proj", "norms", "gate_up", "down")
ABLATIONS = {
    "base": (),
    **{f"no_{k}": (k,) for k in KINDS},
    "gemms_only": ("rope_kv", "attention", "norms"),
    "no_gemms": ("qkv", "o_proj", "gate_up", "down"),
}
# A/B of this session's prefetches: the full layer with one or both undone
VARIANTS = {
    "new": (),
    "old_kv": ("old_kv",),  # attention without its K/V asked of L2 before the PDL wait
    "old_o_proj": ("old_o_proj",),  # o_proj on the table's choice (cuBLAS), no whole prefetch
    "old": ("old_kv", "old_o_proj"),
}


def _patch(removed: tuple[str, ...]):
    """Replace the removed kernels with unwritten buffers; returns an undo function."""
    from rlt_engine.kernels import gate_up_swiglu
    from rlt_engine.models import layers, ouro
    from rlt_engine.worker.attention import TritonPagedAttention

    cache: dict = {}

    def blank(rows: int, n: int, like: torch.Tensor) -> torch.Tensor:
        key = (rows, n, like.dtype)
        if key not in cache:  # no kernel: empty, and allocated once per shape
            cache[key] = torch.empty(rows, n, dtype=like.dtype, device=like.device)
        return cache[key]

    saved = [
        (TritonPagedAttention, "attend_rope", TritonPagedAttention.attend_rope),
        (ouro, "add_norm", ouro.add_norm),
        (layers, "project", layers.project),
        (gate_up_swiglu, "gate_up_silu", gate_up_swiglu.gate_up_silu),
    ]
    real_attend_rope, real_project = TritonPagedAttention.attend_rope, layers.project
    real_gate_up = gate_up_swiglu.gate_up_silu

    def attend_rope(self, layer, q, k, v, rope, meta):
        if "old_kv" in removed:
            from rlt_engine.kernels.rope_kv_write import rope_write_kv_

            rope_write_kv_(q, k, v, *rope, self.k[layer], self.v[layer], meta.slot_mapping)
            return self.attend(layer, q, k, v, meta, kv_written=True)
        if "attention" in removed:
            return blank(q.shape[0], q.shape[1] * q.shape[2], q).view(q.shape)
        if "rope_kv" in removed:
            return self.attend(layer, q, k, v, meta, kv_written=True)
        return real_attend_rope(self, layer, q, k, v, rope, meta)

    def project(x, weight, small_gemm, prefetch_whole=False):
        n, k = weight.shape
        kind = {6144: "qkv", 2048: "o_proj" if k == 2048 else "down"}.get(n)
        if kind in removed:
            return blank(x.shape[0], n, x)
        if "old_o_proj" in removed:
            prefetch_whole = False
        return real_project(x, weight, small_gemm, prefetch_whole)

    def gate_up_silu(x, w, config=None):
        if "gate_up" in removed:
            return blank(x.shape[0], w.shape[0] // 2, x)
        return real_gate_up(x, w, config)

    TritonPagedAttention.attend_rope = attend_rope
    layers.project = project
    gate_up_swiglu.gate_up_silu = gate_up_silu
    if "norms" in removed:
        ouro.add_norm = lambda y, residual, norm, y_norm=None: (y, y)

    def undo():
        for obj, name, value in saved:
            setattr(obj, name, value)

    return undo


# In-place tuning at c = 1 / 8: (GEMM shape, config fields of small_gemm_tables.FIELDS[1:6]) put
# into the table for the m1..m16 buckets, or a "whole" prefetch for a kind; one engine each
SHAPES = {"qkv": "6144x2048", "o_proj": "2048x2048", "gate_up": "11264x2048", "down": "2048x5632"}
TUNE = {
    "table": None,
    "down 64x256 s4 st3": ("down", (64, 256, 4, 4, 3)),
    "down 64x128 s2": ("down", (64, 128, 2, 4, 4)),
    "down 64x128 s8": ("down", (64, 128, 8, 4, 4)),
    "down 32x256 s4": ("down", (32, 256, 4, 4, 4)),
    "down whole": ("down", "whole"),
    "qkv whole": ("qkv", "whole"),
    "o_proj 64x128 s4": ("o_proj", (64, 128, 4, 4, 4)),
    "o_proj 64x256 s2": ("o_proj", (64, 256, 2, 4, 3)),
    "o_proj 32x256 s2": ("o_proj", (32, 256, 2, 4, 4)),
    "gate_up 64x128": ("gate_up", (64, 128, 1, 4, 4)),
    "gate_up 64x256": ("gate_up", (64, 256, 1, 4, 3)),
}


def tune(cs=(1, 8)) -> dict:
    from rlt_engine.kernels import small_gemm
    from rlt_engine.models import layers

    table = small_gemm.serving_table(torch.device("cuda", 0))
    if table is None:
        raise SystemExit("no small-GEMM table serves this GPU: nothing to tune in place")
    rows = {}
    real_project = layers.project
    for name, change in TUNE.items():
        saved = dict(table["entries"])
        if change is not None and change[1] != "whole":
            kind, fields = change
            for m in (1, 2, 4, 8, 16):
                key = f"{SHAPES[kind]}:m{m}:bfloat16"
                table["entries"][key] = ("triton", *fields, *table["entries"][key][6:])
        small_gemm._TABLES.clear()
        if change is not None and change[1] == "whole":
            n_k = tuple(map(int, SHAPES[change[0]].split("x")))

            def project(x, weight, small_gemm, prefetch_whole=False, n_k=n_k):
                whole = prefetch_whole or tuple(weight.shape) == n_k
                return real_project(x, weight, small_gemm, whole)

            layers.project = project
        try:
            llm = _engine(OURO, max_num_seqs=max(cs))
            for c in cs:
                r = _median_rate(llm, c)
                rows[f"{name}/c{c}"] = {
                    "decode_tok_s": r["decode_tok_s_median"],
                    "runs": r["decode_tok_s_runs"],
                }
                print(name, c, round(r["decode_tok_s_median"], 1), flush=True)
            del llm
        finally:
            table["entries"].clear()
            table["entries"].update(saved)
            small_gemm._TABLES.clear()
            layers.project = real_project
    return {"rows": rows}


def variants() -> dict:
    return ablate((1, 8, 64), VARIANTS, "new")


def ablate(cs=(1, 8), runs: dict | None = None, base: str = "base") -> dict:
    rows = {}
    for name, removed in (ABLATIONS if runs is None else runs).items():
        undo = _patch(removed)
        try:
            llm = _engine(OURO, max_num_seqs=max(cs))
            for c in cs:
                r = _median_rate(llm, c)
                rate = r["decode_tok_s_median"]
                rows[f"{name}/c{c}"] = {
                    "removed": list(removed),
                    "c": c,
                    "decode_tok_s": rate,
                    "runs": r["decode_tok_s_runs"],
                    "us_per_traversal": c / rate / DEPTH * 1e6,
                }
                print(name, c, round(rate, 1), flush=True)
            del llm
        finally:
            undo()
    for row in rows.values():
        ref = rows[f"{base}/c{row['c']}"]["us_per_traversal"]
        row["saved_us_per_layer"] = (ref - row["us_per_traversal"]) / LAYERS
    return {"rows": rows}


def _graph_us(body, reps: int = 20) -> float:
    """Median wall time of one replay of a CUDA graph of `body` (CUDA events)."""
    graph = capture(body)
    us = replay_us(graph, reps)
    del graph
    return us


def copy_rate() -> float:
    """Read + written bytes per second of a 2 GiB device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    us = _graph_us(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (us * 1e-6)


def chains() -> dict:
    from rlt_engine.kernels import pdl, small_gemm
    from rlt_engine.kernels.gate_up_swiglu import gate_up_silu
    from rlt_engine.kernels.norm_chain import add_rms_norm
    from rlt_engine.kernels.swiglu import silu_mul

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    shapes = {
        "qkv": (6144, 2048),
        "o_proj": (2048, 2048),
        "gate_up": (11264, 2048),
        "down": (2048, 5632),
    }
    weights = {
        kind: [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
        for kind, (n, k) in shapes.items()
    }
    bw = copy_rate()
    out = {"copy_rate_TBps": bw / 1e12, "rows": {}}

    def mlp_up(x, wgu):
        act = gate_up_silu(x, wgu)
        return silu_mul(small_gemm.linear(x, wgu)) if act is None else act

    def mlp(x, wgu, wd):
        return small_gemm.linear(mlp_up(x, wgu), wd)

    for pdl_on in (True, False):
        pdl._CAPABLE.clear()
        pdl._DISABLED = not pdl_on
        for m in (1, 8):
            xs = {k: torch.randn(m, k, device=dev, dtype=dt) for _, k in shapes.values()}
            for kind in (*shapes, "layer"):
                if kind == "layer":

                    def body(xs=xs):
                        h = xs[2048]
                        for i in range(LAYERS):
                            q = small_gemm.linear(h, weights["qkv"][i])
                            o = small_gemm.linear(q[:, :2048], weights["o_proj"][i])
                            h = mlp(o, weights["gate_up"][i], weights["down"][i])

                    nbytes = sum(n * k for n, k in shapes.values()) * 2
                else:
                    n, k = shapes[kind]

                    def body(kind=kind, k=k, xs=xs):
                        for w in weights[kind]:
                            if kind == "gate_up":
                                mlp_up(xs[k], w)
                            else:
                                small_gemm.linear(xs[k], w)

                    nbytes = n * k * 2
                us = _graph_us(body) / LAYERS
                tbps = nbytes / (us * 1e-6) / 1e12
                key = f"{kind}/m{m}/pdl{int(pdl_on)}"
                # the share convention of bench_small_gemm: weight bytes read per second
                # against the copy's read + written bytes per second
                out["rows"][key] = {"us": us, "TBps": tbps, "share_of_copy": tbps * 1e12 / bw}
                print(key, round(us, 2), round(tbps, 2), flush=True)
        y = torch.randn(8, 2048, device=dev, dtype=dt)
        r = torch.randn_like(y)
        w = torch.ones(2048, device=dev, dtype=dt)

        def norms(y=y, r=r, w=w):
            a, b = y, r
            for _ in range(240):
                a, b = add_rms_norm(a, b, w, 1e-6)

        key = f"add_rms_norm_chain/pdl{int(pdl_on)}"
        out["rows"][key] = {"us_per_launch": _graph_us(norms) / 240}
        print(key, out["rows"][key], flush=True)
    pdl._CAPABLE.clear()
    pdl._DISABLED = False
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", nargs="*", default=["chains", "ablate"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for part in args.parts:
        t = time.perf_counter()
        try:
            result = globals()[part]()
        except Exception as exc:  # record and go on
            import traceback

            result = {"error": repr(exc), "traceback": traceback.format_exc()}
        result = {"gpu": torch.cuda.get_device_name(), "seconds": time.perf_counter() - t, **result}
        (args.out / f"ablation_{part}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
