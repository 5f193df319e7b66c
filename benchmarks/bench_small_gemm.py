"""Small-M weight GEMMs on a GPU: the Triton split-K kernel (kernels/small_gemm.py) against cuBLAS.

    PYTHONPATH=. python benchmarks/bench_small_gemm.py --out $OUT --write-table

For every weight GEMM of Ouro-1.4B and Nanbeige4.2-3B (packed qkv, o_proj, packed gate_up,
down_proj, lm_head; shapes from tests/fixtures/*/config.json) and M = 1, 2, 4, .., 64 bf16 rows,
cuBLAS (F.linear) and every candidate config of the Triton kernel and, on Hopper at M <= 64 for
the GEMMs the model calls ungated (qkv, o_proj, down_proj), of the warp-specialised one
(kernels/ws_gemm.py) (each after checking it: three launches bitwise equal, every element
within rounding of the fp32 matmul) are timed two ways, both triton.testing.do_bench medians (it
flushes the L2 before each call). The packed gate/up is timed as the model runs it, fused with
SwiGLU (kernels/gate_up_swiglu: the Triton kernel's and the ws kernel's forms, against cuBLAS +
silu_mul; checked against silu_mul of the rounded fp32 product):
- graph: one CUDA graph of R back-to-back GEMMs, each on its own copy of the weight (R copies
  are >= 256 MB, several times the 60 MB L2), per GEMM. This is decode's situation (graph
  replays, weights streamed from HBM, no host launch cost) and what the table chooses by;
- call: one eager call (host launch overhead included when it exceeds the flush's GPU time),
  for the best config and cuBLAS.
Reports us, TB/s of weight bytes and their share of a device-to-device copy's bandwidth (read +
written bytes, measured here).

--rank-in-place K: decode in place ranks the tuned shapes' configs too: per shape, the K
fastest configs alone at M = 8 (the c=8 bucket) each take the shape's decode rows (M <= 16,
where the table runs a kernel of ours) and decode in place at c = 1 and 8 (RANK_CS; otherwise
as below); a runner-up replaces the tuned choice only if it decodes RANK_MARGIN faster, and again
in a second, alternated measurement (the best of K noisy rates is biased up). Applied before
--confirm-in-place.

--confirm-in-place: isolated times do not always rank configs as decode does (a kernel's shared
memory decides whether the next kernel's programs start under it with PDL: the ws SwiGLU form on
Nanbeige's gate/up won alone and lost 4% in decode, results/2026-12-02-added-times-h200.md). So
after tuning, per model, decode tok/s in place (dummy weights, 64/32, c = M for each tuned M: the
batch that fills its bucket (`in_place_cs`), engines with one table each) with the new
table, and with each shape whose rows changed reverted to the old table's rows alone; each changed
row (bucket M) stays new unless decode at c = M is IN_PLACE_MARGIN faster with the old rows, and
a bucket whose c the final table decodes IN_PLACE_MARGIN slower than the old one gets all its
old rows back (rows each good alone may lose together). (A
decision per shape, by the mean over the c, kept Ouro's gate/up rows that lost 0.9% at c = 1 and
4 while the shape's mean stayed within the margin, results/2026-12-06-ouro-retune-h100.md.) The
old table is the one this GPU takes now (its own, or one of its layout, on this Triton), else
none (cuBLAS). Writes <out>/small_gemm.json and, with --write-table,
rlt_engine/kernels/small_gemm_tables/<this GPU>.py (and a copy in <out>; the tables of other GPUs
stay as they are): the best config's kernel ("triton" or "ws") where its graph time beats
cuBLAS's by more than MARGIN, else "cublas"; with --only (shapes) or --ms (M values), the tuned
rows replace theirs in the table and the others stay. Only bf16 is tuned (the models' dtype);
other dtypes stay on cuBLAS.

--merge-into NAME: this run's rows (as --confirm-in-place leaves them) go into the table module
small_gemm_tables/NAME.py, line by line, and the rest of it stays as written (its docstring's
account of where each row came from, the other rows); a copy goes to <out>. So an H100, which
takes nvidia_h200's table, updates that table, and commands after it in the same device call
already run its new rows (--write-table writes this GPU's own module, whole).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from rlt_engine.kernels import small_gemm, ws_gemm  # noqa: E402
from rlt_engine.kernels.small_gemm import GemmConfig, gemm, table_key  # noqa: E402
from rlt_engine.kernels.small_gemm_tables import module_name  # noqa: E402

MODELS = {
    "ouro-1.4b": "tests/fixtures/ouro-1.4b",
    "nanbeige4.2-3b": "tests/fixtures/nanbeige4.2-3b",
}
MS = (1, 2, 4, 8, 16, 32, 64)
RANK_CS = (1, 8)  # concurrencies --rank-in-place decodes at
# what the old rows must gain in place, at the c of their bucket, to come back: one table's
# engines run one after another agree to 0.2% at c = 1, 2, 8, 16, 0.5% at c = 4
# (results/2026-12-06-ouro-retune-h100.md)
IN_PLACE_MARGIN = 0.005
RANK_MARGIN = 0.005  # what a runner-up must gain in place, twice, to replace the tuned choice
DECODE_MS = (1, 2, 4, 8, 16)  # the M buckets decode batches of up to 16 rows use
MARGIN = 0.03  # the kernel must beat cuBLAS by 3% (do_bench noise is ~1%) to replace it
# (block_n, block_k, num_warps, num_stages): shared memory per stage is block_n * block_k * 2 B
TILES = ((64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (128, 64, 8, 4), (32, 256, 4, 4))
SPLITS = (1, 2, 4, 6, 8, 16)
# the warp-specialised kernel (block_n, block_k, num_stages; one program an SM, its shared
# memory holding the ring and the program's x rows, or two where a launch has more programs
# than SMs and they fit half of it: ws_gemm.two_per_sm) and the GEMMs it may take: those the
# model calls without a gate (the lm_head's skip needs the Triton kernel)
WS_TILES = ((64, 256, 3), (64, 128, 4), (128, 128, 3), (128, 256, 2), (64, 128, 2), (64, 256, 5),
            (128, 128, 6), (64, 256, 2), (64, 128, 8))  # fmt: skip
WS_SPLITS = (1, 2, 4, 6, 8)
WS_GEMMS = ("qkv", "o_proj", "down_proj")
# the packed gate/up runs fused with SwiGLU (kernels/gate_up_swiglu): timed in that form, the
# Triton kernel's (block_n split into gate and up halves, no split-K) against the ws kernel's
# (block_n / 2 rows of each, no split-K) and cuBLAS + silu_mul; (128, 128, 2) and (128, 128, 3)
# fit half an SM's shared memory, two programs an SM where a launch has more programs than
# SMs (ws_gemm.two_per_sm: Nanbeige's gate/up); block_n 64 is ws_gemm.halves (32 gate + 32 up
# rows in one MMA: Ouro's gate/up in 176 programs, two an SM)
SWIGLU_GEMMS = ("gate_up",)
WS_SWIGLU_TILES = ((128, 128, 3), (128, 256, 2), (128, 64, 4), (256, 64, 3), (128, 128, 5),
                   (128, 128, 6), (128, 128, 2), (64, 128, 4), (64, 128, 6),
                   (64, 256, 3))  # fmt: skip
DEVICE = "cuda"
TABLES_DIR = ROOT / "rlt_engine" / "kernels" / "small_gemm_tables"  # a module per GPU model


def model_shapes() -> dict[str, tuple[int, int]]:
    """name -> (N, K) of each weight GEMM, from the checked-in configs."""
    shapes = {}
    for model, path in MODELS.items():
        c = json.loads((ROOT / path / "config.json").read_text())
        hidden, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        shapes[f"{model}/qkv"] = ((heads + 2 * kv) * d, hidden)
        shapes[f"{model}/o_proj"] = (hidden, heads * d)
        shapes[f"{model}/gate_up"] = (2 * inter, hidden)
        shapes[f"{model}/down_proj"] = (hidden, inter)
        shapes[f"{model}/lm_head"] = (c["vocab_size"], hidden)
    return shapes


def form_of(names: list[str]) -> str:
    """How the model calls a shape: "swiglu" (gate_up_silu), "ws" (ungated: the warp-
    specialised kernel may take it) or "plain" (the gated lm_head: the Triton kernel only)."""
    kinds = {name.split("/")[1] for name in names}
    return "swiglu" if kinds & set(SWIGLU_GEMMS) else "ws" if kinds & set(WS_GEMMS) else "plain"


def candidates(n: int, k: int, m: int, form: str, rope: bool = False) -> list[GemmConfig]:
    """Tiles x splits that give 1/2..~12 waves of programs over the SMs, >= 2 K blocks a split;
    the warp-specialised kernel's where `form` allows (<= 2 waves, its ring and x rows within a
    block's shared memory: ws_gemm.shared_bytes, with the RoPE epilogue's exchange where
    `rope`, the packed qkv's decode form).
    "swiglu": the fused forms' configs (no split-K; the Triton kernel's halves >= 32 rows)."""
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    swiglu = form == "swiglu"
    out = []
    for bn, bk, warps, stages in TILES:
        tiles = -(-n // bn)
        for s in (1,) if swiglu else SPLITS:
            if s > 1 and (k // s < 2 * bk or not sms // 2 <= tiles * s <= 12 * sms):
                continue
            if not swiglu or bn >= 64:
                out.append(GemmConfig(bn, bk, s, warps, stages))
    if form != "plain" and ws_gemm.available(torch.device(DEVICE)):
        tiles_splits = [(t, 1) for t in WS_SWIGLU_TILES] if swiglu else [
            (t, s) for t in WS_TILES for s in WS_SPLITS
        ]  # fmt: skip
        for (bn, bk, stages), s in tiles_splits:
            n_tiles = n // bn * s
            if ws_gemm.check(n, k, m, bn, bk, s, swiglu, stages, rope) is None and (
                sms // 2 <= n_tiles <= 2 * sms or swiglu
            ):
                out.append(GemmConfig(bn, bk, s, 4, stages, kernel="ws"))
    return out


def bench_us(fn, warmup: int, rep: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")) * 1e3


def copy_bandwidth(gib: int = 2) -> float:
    """Device-to-device copy in bytes/s, counting bytes read and written."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src), 10, 100)
    return 2 * (gib << 30) / (us * 1e-6)


def graph_us(call, x: torch.Tensor, weights: list[torch.Tensor], args) -> float:
    """Device time per GEMM in a CUDA graph of len(weights) back-to-back calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:  # compiled and warm before the capture
            call(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            call(x, w)
    us = bench_us(graph.replay, args.warmup, args.rep) / len(weights)
    del graph
    return us


def rounding_bound(x: torch.Tensor, w32: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """1 bf16 ulp of the fp32 reference + 2^-20 sum|x w| (the GPU tests' bound)."""
    absprod = x.float().abs() @ w32.abs().T
    return torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7) + 2.0**-20 * absprod


def tune(
    n: int,
    k: int,
    m: int,
    weights: list[torch.Tensor],
    w32: torch.Tensor,
    form: str,
    args,
    rope: bool = False,
    current: GemmConfig | None = None,
) -> dict:
    """`form` (see `form_of`): "swiglu" times and checks the fused gate/up + SwiGLU forms
    against silu_mul of the rounded fp32 product (2 bf16 ulps: the product's rounding goes
    through the activation) and cuBLAS + silu_mul; else the plain GEMM against the product's
    rounding bound and cuBLAS."""
    from rlt_engine.kernels.gate_up_swiglu import gate_up_silu
    from rlt_engine.kernels.swiglu import silu_mul

    w = weights[0]
    gen = torch.Generator(device=DEVICE).manual_seed(m)
    x = torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    ref = x.float() @ w32.T
    if form == "swiglu":
        ref = silu_mul(ref.to(torch.bfloat16)).float()
        bound = ref.abs() * 2.0**-6 + 2.0**-20 * float((x.float().abs() @ w32.abs().T).max())
        run, base = gate_up_silu, lambda a, b: silu_mul(F.linear(a, b))
    else:
        bound = rounding_bound(x, w32, ref)
        run, base = gemm, F.linear
    cublas = graph_us(base, x, weights, args)
    runs, rejected = [], []
    configs = candidates(n, k, m, form, rope)
    if args.ws_only:  # the ws configs against the row this GPU runs now (and cuBLAS)
        configs = [c for c in configs if c.kernel == "ws"] + [c for c in [current] if c]
    for config in configs:
        try:
            outs = [run(x, w, config) for _ in range(3)]
        except Exception as exc:  # a config the compiler refuses (shared memory, ...)
            rejected.append({"config": config.as_dict(), "why": repr(exc)[:200]})
            continue
        same = all(torch.equal(o, outs[0]) for o in outs)
        excess = float(((outs[0].float() - ref).abs() - bound).max())
        # split-K's tickets are zero between launches; a config that leaves one set would
        # break every later split-K launch in this process, so it is named and the counters reset
        counters = small_gemm._counters(x.device)
        left = int(torch.count_nonzero(counters))
        if not same or excess > 0 or left:
            why = f"deterministic={same}, excess over the rounding bound {excess:.3g}"
            why += f", {left} ticket counters left non-zero" if left else ""
            counters.zero_()
            rejected.append({"config": config.as_dict(), "why": why})
            continue
        us = graph_us(lambda a, b, c=config: run(a, b, c), x, weights, args)
        runs.append({"config": config.as_dict(), "graph_us": us})
    runs.sort(key=lambda r: r["graph_us"])
    best = runs[0] if runs else None
    if best is not None:
        config = GemmConfig(**best["config"])
        best["call_us"] = bench_us(lambda: run(x, w, config), args.warmup, args.rep)
    wins = best is not None and best["graph_us"] < cublas * (1 - MARGIN)
    return {
        "n": n,
        "k": k,
        "m": m,
        "form": form,
        "graph_copies": len(weights),
        "cublas_graph_us": cublas,
        "cublas_call_us": bench_us(lambda: base(x, w), args.warmup, args.rep),
        "best": best,
        "backend": best["config"]["kernel"] if wins else "cublas",
        "speedup": cublas / best["graph_us"] if best else None,
        "top": runs[:5],
        "rejected": rejected,
    }


def table_entry(r: dict) -> tuple:
    """One table row (FIELDS): the choice, the best config (also kept where cuBLAS won), and the
    per-GEMM graph times it was chosen by."""
    best = r["best"] or {"config": GemmConfig().as_dict(), "graph_us": float("nan")}
    c = GemmConfig(**best["config"])
    times = round(best["graph_us"], 2), round(r["cublas_graph_us"], 2)
    return (r["backend"], c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages, *times)


def write_table(path: Path, meta: dict, entries: dict[str, tuple]) -> None:
    """A Python module that `ruff format` leaves as it is (one row per line)."""
    # the shapes --confirm-in-place tried: its report's entries with a verdict
    reports = meta.get("in_place", {}).values()
    checked = sorted({k for r in reports for k, v in r.items() if "kept" in v})
    ranked = sorted({k for r in meta.get("in_place_rank", {}).values() for k in r})
    notes = []
    if ranked:
        notes.append(
            f"decode in place ranked the configs of (--rank-in-place): {', '.join(ranked)}"
        )
    if checked:
        notes.append(f"the shapes checked in decode (--confirm-in-place): {', '.join(checked)}")
    tail = ["times (do_bench medians) the choice was made by; in the last run"] + [
        f"{note}{';' if i < len(notes) - 1 else '.'}" for i, note in enumerate(notes)
    ]
    if not notes:
        tail = ["times (do_bench medians) the choice was made by."]
    tail[-1] += '"""'
    lines = [
        '"""Small-GEMM dispatch table of the GPU named below (kernels/small_gemm_tables):',
        "written by benchmarks/bench_small_gemm.py on that GPU; do not edit by hand. Keys are",
        '"NxK:m<bucket>:<dtype>"; rows are FIELDS, "us" and "cublas_us" the per-GEMM CUDA-graph',
        *tail,
        "",
        "TABLE: dict = {",
        f'    "device": {json.dumps(meta["device"])},',
        f'    "capability": {json.dumps(meta["capability"])},',
        f'    "sms": {meta["sms"]},',
        f'    "triton": {json.dumps(meta["triton"])},',
        f'    "torch": {json.dumps(meta["torch"])},',
        '    "entries": {',
    ]
    lines += [_row_line(key, row) for key, row in entries.items()]
    lines += ["    },", "}", ""]
    path.write_text("\n".join(lines).replace("'", '"'))


def _row_key(key: str) -> str:
    """The start of a table row's line: its indent and its quoted key."""
    return f"        {json.dumps(key)}:"


def _row_line(key: str, row: tuple) -> str:
    """A table row as its module writes it (one line, double quotes: ruff leaves it)."""
    return f"{_row_key(key)} {row!r},".replace("'", '"')


def merge_rows(path: Path, rows: dict[str, tuple]) -> list[str]:
    """Put `rows` into the table module at `path`: each key's line replaced where it has one,
    else added at the end of its entries; every other line stays. Returns the keys whose row
    changed."""
    lines = path.read_text().splitlines()
    end = lines.index("    },", lines.index('    "entries": {'))  # the entries' closing line
    changed = []
    for key, row in rows.items():
        line = _row_line(key, row)
        at = [i for i, text in enumerate(lines[:end]) if text.startswith(_row_key(key))]
        if at and lines[at[0]] == line:
            continue
        if at:
            lines[at[0]] = line
        else:
            lines.insert(end, line)
            end += 1
        changed.append(key)
    path.write_text("\n".join(lines) + "\n")
    return changed


def shape_rows(entries: dict, n: int, k: int) -> dict:
    """The table rows of the [*, k] @ [n, k].T GEMM (every M bucket and dtype)."""
    return {key: row for key, row in entries.items() if key.startswith(f"{n}x{k}:")}


def with_rows(entries: dict, rows_from: dict, n: int, k: int) -> dict:
    """`entries` with shape (n, k)'s rows as `rows_from` has them (none where it has none)."""
    out = {key: row for key, row in entries.items() if not key.startswith(f"{n}x{k}:")}
    return out | shape_rows(rows_from, n, k)


def mean_speedup(rates: dict[int, float], base: dict[int, float]) -> float:
    return statistics.mean(rates[c] / base[c] for c in base)


def configs_of(entries: dict, n: int, k: int) -> dict:
    """shape_rows without the times: what a GEMM of that shape runs, bucket by bucket."""
    return {key: row[:6] for key, row in shape_rows(entries, n, k).items()}


def bucket_of(key: str) -> int:
    """A table key's M bucket: "2048x2048:m8:bfloat16" -> 8."""
    return int(key.split(":")[1][1:])


def revert(entries: dict, old: dict, key: str) -> None:
    """`entries[key]` back to `old`'s row, or gone where `old` has none."""
    entries.pop(key, None)
    if key in old:
        entries[key] = old[key]


def confirm_in_place(old: dict, new: dict, shapes_by_model: dict, rate) -> tuple[dict, dict]:
    """`new` with each changed row reverted to `old`'s (or dropped where `old` has none) where
    decode at its own batch (c = its bucket) is more than IN_PLACE_MARGIN faster in place with
    the shape's old rows: each changed shape's rows are tried together against `new`, and
    each bucket decided by the rate at the c that runs it (a bucket not measured: by the mean
    over the measured c). Then the final table against the old one: at a c where the final
    decodes more than the margin slower, that bucket's changed rows all go back.
    shapes_by_model: model -> [(n, k), ..]; rate(model, entries) -> {c: decode tok/s}."""
    entries, report = dict(new), {}
    for model, shapes in shapes_by_model.items():
        changed = [nk for nk in shapes if configs_of(old, *nk) != configs_of(new, *nk)]
        if not changed:
            continue
        print(f"{model} in place: the new table", flush=True)
        base = rate(model, new)
        report[model] = {"new": base}
        for n, k in changed:
            print(f"{model} in place: the new table, {n}x{k}'s old rows back", flush=True)
            trial = rate(model, with_rows(new, old, n, k))
            mean = mean_speedup(trial, base)
            kept = {}
            configs_old, configs_new = configs_of(old, n, k), configs_of(new, n, k)
            for key in sorted(set(configs_old) | set(configs_new), key=bucket_of):
                if configs_old.get(key) == configs_new.get(key):
                    continue
                c = bucket_of(key)
                gain = trial[c] / base[c] if c in base else mean
                kept[key] = "new" if gain <= 1 + IN_PLACE_MARGIN else "old"
                if kept[key] == "old":
                    revert(entries, old, key)
            report[model][f"{n}x{k}"] = {"old_rows": trial, "old_rows_speedup": mean, "kept": kept}
        print(f"{model} in place: the final table, then the old", flush=True)
        final = report[model]["final"] = rate(model, entries)
        before = report[model]["old"] = rate(model, old)
        # rows each good alone may lose together: a batch the final table decodes more than
        # the margin slower than the old one gets the old table's rows of its bucket back
        back = [c for c in final if before[c] > final[c] * (1 + IN_PLACE_MARGIN)]
        for c in back:
            for n, k in changed:
                for key in set(configs_of(old, n, k)) | set(configs_of(new, n, k)):
                    if bucket_of(key) == c:
                        revert(entries, old, key)
        report[model]["buckets_back"] = back
    return entries, report


def rank_in_place(
    entries: dict, results: list[dict], shapes_by_model: dict, rate, k: int
) -> tuple[dict, dict]:
    """`entries` with each shape's decode rows (DECODE_MS, where not cuBLAS) set to the config
    of its K fastest at M = 8 (`results`: tune()'s, with "top") that decodes fastest in place,
    if that beats the tuned choice by RANK_MARGIN in two measurements. rate: see
    confirm_in_place."""
    entries, report = dict(entries), {}
    by_key = {(r["n"], r["k"], r["m"]): r for r in results}
    for model, shapes in shapes_by_model.items():
        for n, kd in shapes:
            keys = {m: table_key(n, kd, m, torch.bfloat16) for m in DECODE_MS}
            decode = {m: key for m, key in keys.items()
                      if entries.get(key, ("cublas",))[0] != "cublas"}  # fmt: skip
            r8 = by_key.get((n, kd, 8))
            if not decode or r8 is None:
                continue
            tuned_key = decode.get(8, next(iter(decode.values())))  # the c=8 bucket's row
            tuned = GemmConfig(*_config_fields(entries[tuned_key]))
            configs = [GemmConfig(**t["config"]) for t in r8["top"][:k]]
            configs = [c for c in dict.fromkeys(configs) if c != tuned]
            if not configs:
                continue
            base = rate(model, entries)
            shape_report: dict = {"tuned": tuned.as_dict(), "tuned_rates": base, "tried": []}
            best, best_gain, best_entries = None, 1.0, entries
            for config in configs:
                trial = dict(entries)
                for m, key in decode.items():
                    times = by_key.get((n, kd, m), {}).get("top", [])
                    us = next((t["graph_us"] for t in times if t["config"] == config.as_dict()),
                              float("nan"))  # fmt: skip
                    trial[key] = (config.kernel, config.block_n, config.block_k, config.split_k,
                                  config.num_warps, config.num_stages, round(us, 2),
                                  entries[key][7])  # fmt: skip
                rates = rate(model, trial)
                gain = mean_speedup(rates, base)
                shape_report["tried"].append(
                    {"config": config.as_dict(), "rates": rates, "speedup": gain}
                )
                if gain > best_gain:
                    best, best_gain, best_entries = config, gain, trial
            if best is not None and best_gain > 1 + RANK_MARGIN:
                again = rate(model, best_entries)  # alternated: the winner, then the tuned
                again_base = rate(model, entries)
                shape_report["again"] = {"best": again, "tuned": again_base}
                if mean_speedup(again, again_base) > 1 + RANK_MARGIN:
                    entries = best_entries
                    shape_report["chosen"] = best.as_dict()
            report.setdefault(model, {})[f"{n}x{kd}"] = shape_report
    return entries, report


def _config_fields(row: tuple) -> tuple:
    """A table row's GemmConfig fields (block_n, block_k, split_k, num_warps, num_stages,
    kernel)."""
    backend, bn, bk, split, warps, stages = row[:6]
    return bn, bk, split, warps, stages, backend


def in_place_cs(ms: list[int]) -> tuple[int, ...]:
    """The concurrencies decode in place is measured at for rows of these M buckets: c = M for
    each (a batch of M sequences decodes M rows). Checking the 1-16-row buckets at c = 1 and 8
    alone missed what the others see: Nanbeige's qkv on the ws kernel gained 1% at c = 2 / 4
    and nothing at 8 / 16, its re-tuned down 2.4% at c = 16 (results/
    2026-12-06-nanbeige-qkv-ws-h100.md)."""
    return tuple(sorted(set(ms)))


def decode_rates(model: str, entries: dict, cs: tuple[int, ...] = RANK_CS) -> dict[int, float]:
    """Committed decode tok/s of `model` (dummy bf16 weights) with the table `entries`, at each
    concurrency of `cs` (as many slots as the largest)."""
    from h200_decode import _engine, _median_rate

    small_gemm._TABLES.clear()
    small_gemm._TABLES[torch.cuda.current_device()] = entries
    try:
        llm = _engine(ROOT / MODELS[model], max_num_seqs=max(8, *cs))
        rates = {c: _median_rate(llm, c)["decode_tok_s_median"] for c in cs}
        print(model, {c: round(r, 1) for c, r in rates.items()}, flush=True)
        del llm
        return rates
    finally:
        small_gemm._TABLES.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--write-table", action="store_true")
    ap.add_argument("--warmup", type=int, default=5, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=int, default=20, help="do_bench repetitions, ms")
    ap.add_argument("--only", nargs="*", help="shape names (e.g. ouro-1.4b/qkv)")
    ap.add_argument(
        "--ms", type=int, nargs="*", default=list(MS), help="the M values to tune (their rows)"
    )
    ap.add_argument(
        "--ws-only",
        action="store_true",
        help="time only the ws kernel's configs against the current row's config and cuBLAS",
    )
    ap.add_argument("--confirm-in-place", action="store_true", help="see the module docstring")
    ap.add_argument("--rank-in-place", type=int, default=0, metavar="K", help="see the docstring")
    ap.add_argument("--merge-into", metavar="NAME", help="a table module: see the docstring")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    import triton

    t0 = time.perf_counter()
    copy_bps = copy_bandwidth()
    meta = {
        "device": torch.cuda.get_device_name(DEVICE),
        "capability": "{}.{}".format(*torch.cuda.get_device_capability(DEVICE)),
        "sms": torch.cuda.get_device_properties(DEVICE).multi_processor_count,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "copy_tb_s": copy_bps / 1e12,
        "do_bench_ms": [args.warmup, args.rep],
        "margin": MARGIN,
    }
    print(f"copy bandwidth {copy_bps / 1e12:.2f} TB/s (read + written)", flush=True)
    shapes = model_shapes()
    results, entries = [], {}  # entries: key -> table row
    # what this GPU runs now: its own table, or one of its layout (small_gemm.pick_table); an
    # --only or --ms run keeps the other rows from it, so a first table of this GPU does not
    # drop the rows it took from another GPU's
    table = small_gemm.serving_table(torch.device(DEVICE))
    old = dict(table["entries"]) if table is not None else {}
    table_path = TABLES_DIR / f"{module_name(meta['device'])}.py"
    if args.only or set(args.ms) != set(MS):  # the other rows stay
        entries = dict(old)
    tuned: list[str] = []  # this run's keys (--merge-into)
    merge_target = TABLES_DIR / f"{args.merge_into}.py" if args.merge_into else None
    if merge_target is not None and not merge_target.is_file():
        raise SystemExit(f"--merge-into: no table module {args.merge_into} in {TABLES_DIR}")

    def save(entries: dict) -> None:
        meta["seconds"] = time.perf_counter() - t0
        (args.out / "small_gemm.json").write_text(
            json.dumps({**meta, "results": results}, indent=1) + "\n"
        )
        if args.write_table:
            write_table(table_path, meta, entries)
            write_table(args.out / table_path.name, meta, entries)
        if merge_target is not None:
            changed = merge_rows(merge_target, {key: entries[key] for key in tuned})
            (args.out / merge_target.name).write_text(merge_target.read_text())
            if changed:
                print(f"{merge_target.name}: rows {', '.join(changed)}", flush=True)

    by_nk: dict[tuple[int, int], list[str]] = {}
    for name, nk in shapes.items():
        if not args.only or name in args.only:
            by_nk.setdefault(nk, []).append(name)
    for (n, k), names in by_nk.items():
        gen = torch.Generator(device=DEVICE).manual_seed(n + k)
        w = (torch.randn(n, k, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16)
        w32 = w.float()
        wbytes = n * k * w.element_size()
        copies = min(32, max(2, -(-(256 << 20) // wbytes)))
        weights = [w] + [w.clone() for _ in range(copies - 1)]
        rope = any(name.endswith("/qkv") for name in names)  # its decode form: with RoPE
        for m in args.ms:
            current = small_gemm.lookup(old, n, k, m, torch.bfloat16, gated=True)
            r = tune(n, k, m, weights, w32, form_of(names), args, rope, current)
            best = r["best"] or {}
            for side, key in (("cublas", "cublas_graph_us"), ("cublas_call", "cublas_call_us")):
                r[f"{side}_tb_s"] = wbytes / (r[key] * 1e-6) / 1e12
            for side, key in (("triton", "graph_us"), ("triton_call", "call_us")):
                if key in best:
                    r[f"{side}_tb_s"] = wbytes / (best[key] * 1e-6) / 1e12
            for side in ("cublas", "triton"):
                if f"{side}_tb_s" in r:
                    r[f"{side}_copy_share"] = r[f"{side}_tb_s"] * 1e12 / copy_bps
            r["names"] = names
            results.append(r)
            entries[table_key(n, k, m, torch.bfloat16)] = table_entry(r)
            tuned.append(table_key(n, k, m, torch.bfloat16))
            nan = float("nan")
            print(
                f"{'+'.join(names):26s} m={m:2d} graph: cublas {r['cublas_graph_us']:6.1f} us "
                f"({r['cublas_tb_s']:.2f} TB/s) triton {best.get('graph_us', nan):6.1f} us "
                f"({r.get('triton_tb_s', nan):.2f} TB/s, {r.get('triton_copy_share', nan):.0%}"
                f" of copy) | call: cublas {r['cublas_call_us']:6.1f} triton "
                f"{best.get('call_us', nan):6.1f} | {best.get('config')} -> {r['backend']}",
                flush=True,
            )
        del weights
        del w, w32
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        save(entries)  # after every shape: a run cut short still leaves what it measured
    shapes_by_model: dict[str, list[tuple[int, int]]] = {}
    for nk, names in by_nk.items():
        for name in names:
            shapes_by_model.setdefault(name.split("/")[0], []).append(nk)
    if args.rank_in_place:
        entries, ranked = rank_in_place(
            entries, results, shapes_by_model, decode_rates, args.rank_in_place
        )
        meta["in_place_rank"] = ranked
        save(entries)
    if args.confirm_in_place:
        cs = in_place_cs(args.ms)
        entries, report = confirm_in_place(
            old, entries, shapes_by_model, lambda model, rows: decode_rates(model, rows, cs)
        )
        meta["in_place"] = report
        save(entries)
    small_gemm._TABLES.clear()
    print(f"done in {meta['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
