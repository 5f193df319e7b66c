"""Triton paged attention vs the torch gather reference: decode rows (and two prefill chunks).

Ouro-1.4B attention by default (16 heads, 16 kv heads, head_dim 128, block 16, bf16). Every
sequence of a cell has the same context; blocks are shuffled over the pool. Times are medians in
ms: `triton` with triton.testing.do_bench (eager, includes the Python launch), `graph` with
do_bench_cudagraph (GPU time, as inside the engine's CUDA graphs), per num_splits; `torch` is
the torch backend's math (gather K/V by slot, fp32 masked softmax). GB/s = K/V bytes read / best
graph time; err = max |triton - torch| over the splits. --layout places the blocks in a pool of
--pool-blocks (default: just the blocks used): shuffled (a random permutation), contiguous (each
sequence one run), interleaved (block j of sequence i at j * seqs + i: a batch that grew one
block per sequence at a time), or grown (the first --prompt-blocks of each sequence one run, the
rest interleaved after them: the engine's growing KV without spare blocks). --kernel /
--block-n / --num-warps / --num-stages try other kernels and launch options (through the
private `_launch`; by default the choices `paged_attention` makes).

    python benchmarks/bench_paged_attention.py                      # table + JSON to $OUT if set
    python benchmarks/bench_paged_attention.py --concurrency 8 --contexts 4096 --splits 1 4 16
    python benchmarks/bench_paged_attention.py --merged --concurrency 8 --contexts 2000 --splits 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from rlt_engine.kernels.paged_attention import _launch, supported

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_inputs(num_seqs, q_len, ctx, args, dtype, gen):
    """Cache with shuffled blocks, tables, lengths, and q for `num_seqs` sequences whose last
    `q_len` positions (of `ctx`) are queries."""
    bs = args.block_size
    per_seq = math.ceil(ctx / bs)
    num_blocks = max(num_seqs * per_seq, args.pool_blocks or 0)
    shape = (num_blocks * bs, args.kv_heads, args.head_dim)
    k = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    tables = block_tables(args.layout, num_seqs, per_seq, args.prompt_blocks, num_blocks, gen)
    seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
    query_start = torch.arange(0, num_seqs + 1, dtype=torch.int32, device="cuda") * q_len
    q = torch.randn(
        (num_seqs * q_len, args.heads, args.head_dim), device="cuda", dtype=dtype, generator=gen
    )
    pos = torch.arange(ctx, device="cuda")
    slots = tables[:, pos // bs].long() * bs + pos % bs  # what the torch backend is handed
    return q, k, v, tables, seq_lens, query_start, slots


def block_tables(layout, num_seqs, per_seq, prompt_blocks, num_blocks, gen) -> torch.Tensor:
    """[num_seqs, per_seq] int32 physical blocks of a pool of `num_blocks` (see the module doc);
    the used blocks start at a random offset in the pool, as a FIFO free list leaves them."""
    used = num_seqs * per_seq
    if layout == "shuffled":
        order = torch.randperm(num_blocks, device="cuda", generator=gen)[:used]
        return order.to(torch.int32).view(num_seqs, per_seq).contiguous()
    seq = torch.arange(num_seqs, device="cuda")[:, None]
    j = torch.arange(per_seq, device="cuda")[None, :]
    if layout == "contiguous":
        local = seq * per_seq + j
    elif layout == "interleaved":
        local = j * num_seqs + seq
    else:  # grown
        first = min(prompt_blocks, per_seq)
        local = torch.where(
            j < first, seq * first + j, num_seqs * first + (j - first) * num_seqs + seq
        )
    start = int(torch.randint(0, num_blocks - used + 1, (1,), device="cuda", generator=gen))
    return (local + start).to(torch.int32).contiguous()


def torch_reference(q, k, v, slots, q_len, scale):
    """The torch backend's math: gather keys per sequence, fp32 scores, causal mask, softmax."""
    num_seqs, ctx = slots.shape
    heads, kv_heads = q.shape[1], k.shape[1]
    keys, vals = k[slots].float(), v[slots].float()  # [n, ctx, kvh, d]
    if heads != kv_heads:
        keys = keys.repeat_interleave(heads // kv_heads, dim=2)
        vals = vals.repeat_interleave(heads // kv_heads, dim=2)
    qs = q.view(num_seqs, q_len, heads, -1).float()
    scores = torch.einsum("bnhd,bchd->bhnc", qs, keys) * scale
    visible = torch.ones(q_len, ctx, dtype=torch.bool, device=q.device).tril(ctx - q_len)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("bhnc,bchd->bnhd", probs, vals).reshape(q.shape).to(q.dtype)


def bench_cell(num_seqs, q_len, ctx, args, dtype, gen):
    q, k, v, tables, seq_lens, query_start, slots = make_inputs(
        num_seqs, q_len, ctx, args, dtype, gen
    )
    scale = args.head_dim**-0.5
    out = torch.empty_like(q)
    kv_bytes = 2 * num_seqs * ctx * args.kv_heads * args.head_dim * k.element_size()
    row = {"num_seqs": num_seqs, "q_len": q_len, "context": ctx, "kv_bytes": kv_bytes}

    def run(splits):
        tune = {
            "num_warps": args.num_warps,
            "num_stages": args.num_stages,
            "block_n": args.block_n,
            "kernel": args.kernel,
        }
        # --merged: the decode form the engine runs (the last split merges, no second launch)
        counters = (
            torch.zeros(num_seqs * args.kv_heads, dtype=torch.int32, device="cuda")
            if args.merged and splits > 1 and q_len == 1
            else None
        )
        return lambda: _launch(
            q,
            k,
            v,
            tables,
            seq_lens,
            query_start,
            args.block_size,
            scale,
            q_len,
            splits,
            out,
            split_counters=counters,
            **tune,
        )

    try:
        ref = torch_reference(q, k, v, slots, q_len, scale)
        torch_ms = do_bench(lambda: torch_reference(q, k, v, slots, q_len, scale))
        row["torch_ms"] = float(torch_ms)
    except torch.OutOfMemoryError:
        ref, row["torch_ms"] = None, None
        torch.cuda.empty_cache()
    row["triton_ms"], row["graph_ms"], row["max_abs_err"] = {}, {}, {}
    splits_list = args.splits if q_len == 1 else [1]
    for splits in splits_list:
        fn = run(splits)
        fn()
        if ref is not None:
            row["max_abs_err"][splits] = (out.float() - ref.float()).abs().max().item()
        row["triton_ms"][splits] = float(do_bench(fn, return_mode="median"))
        row["graph_ms"][splits] = float(do_bench_cudagraph(fn, return_mode="median"))
    best = min(row["graph_ms"], key=row["graph_ms"].get)
    row["best_splits"] = best
    row["best_graph_gbps"] = kv_bytes / (row["graph_ms"][best] * 1e-3) / 1e9
    if row["torch_ms"]:
        row["speedup_vs_torch"] = row["torch_ms"] / row["graph_ms"][best]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--prefill",
        type=int,
        nargs="*",
        default=[512, 2048],
        help="contexts ending in a 512-token prefill chunk, 4 sequences (none: skip)",
    )
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--layout", choices=("shuffled", "contiguous", "interleaved", "grown"), default="shuffled"
    )
    parser.add_argument("--pool-blocks", type=int, default=0, help="blocks in the pool")
    parser.add_argument("--prompt-blocks", type=int, default=4, help="--layout grown: first run")
    parser.add_argument("--num-warps", type=int, default=None, help="kernel launch option")
    parser.add_argument("--num-stages", type=int, default=None, help="kernel launch option")
    parser.add_argument("--block-n", type=int, default=None, help="keys per inner tile")
    parser.add_argument(
        "--kernel",
        choices=("auto", "mma", "rows"),
        default="auto",
        help="tensor-core kernel, decode-rows kernel (MHA decode only), or the engine's choice",
    )
    parser.add_argument(
        "--merged", action="store_true", help="decode splits merged in the kernel (the engine's)"
    )
    parser.add_argument("--out", default=None, help="JSON path (default: $OUT/... when set)")
    args = parser.parse_args()

    ok, why = supported(torch.device("cuda"))
    if not ok:
        raise SystemExit(f"cannot run the Triton kernel here: {why}")
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    cols = " ".join(f"{'splits=' + str(s) + ' eager/graph':>22}" for s in args.splits)
    print(
        f"{'seqs':>4} {'q':>4} {'ctx':>5} {'torch':>8} {cols} {'best':>4} {'GB/s':>5} "
        f"{'xtorch':>6} {'err':>7}"
    )
    rows = []
    cells = [(c, 1, ctx) for c in args.concurrency for ctx in args.contexts]
    cells += [(4, min(512, ctx), ctx) for ctx in args.prefill]  # chunk at the end of ctx
    for num_seqs, q_len, ctx in cells:
        rows.append(bench_cell(num_seqs, q_len, ctx, args, dtype, gen))
        print(format_row(rows[-1], args.splits), flush=True)
        torch.cuda.empty_cache()

    result = {
        "device": torch.cuda.get_device_name(),
        "num_sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": rows,
    }
    path = args.out
    if path is None and os.environ.get("OUT"):
        path = str(Path(os.environ["OUT"]) / "bench_paged_attention.json")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")


def format_row(row, splits) -> str:
    cells = [
        f"{row['triton_ms'][s]:.4f}/{row['graph_ms'][s]:.4f}" if s in row["graph_ms"] else "-"
        for s in splits
    ]
    torch_ms = f"{row['torch_ms']:.3f}" if row["torch_ms"] else "oom"
    err = max(row["max_abs_err"].values(), default=float("nan"))
    return (
        f"{row['num_seqs']:>4} {row['q_len']:>4} {row['context']:>5} {torch_ms:>8} "
        + " ".join(f"{c:>22}" for c in cells)
        + f" {row['best_splits']:>4} {row['best_graph_gbps']:5.0f}"
        f" {row.get('speedup_vs_torch', float('nan')):6.1f} {err:7.1e}"
    )


if __name__ == "__main__":
    main()
