"""Full-size model with dummy weights: bf16 modules vs the fp32 dense oracle on the same weights.

Reports, per loop depth, the max relative error of the logits (max |bf16 - fp32| / max |fp32|),
top-1 agreement over the prompt positions, the exit-hazard error, greedy-decode agreement with
the oracle's greedy decoder, and peak GPU memory.

    python benchmarks/oracle_check.py --out results.json            # Ouro-1.4B config
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from rlt_engine.checkpoints.loader import load_model
from rlt_engine.oracle.contiguous_kv import ContiguousKVCache, ContiguousMetadata, greedy_decode
from rlt_engine.oracle.reference import reference_forward, reference_greedy

KNOWN = Path(__file__).resolve().parents[1] / "rlt_engine/checkpoints/known_configs"


@torch.inference_mode()
def module_per_depth(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prefill through the modules at full depth; logits [D, T, V] and hazards [D, T]."""
    cache = ContiguousKVCache(model.config, 1, len(ids), model.lm_head.weight.dtype, ids.device)
    pos = torch.arange(len(ids), device=ids.device)
    zeros = torch.zeros_like(pos)
    hidden, logits, hazards = model.prelude(ids), [], []
    for loop in range(model.num_loops):
        meta = ContiguousMetadata(positions=pos, loop_indices=zeros + loop, seq_ids=zeros)
        out = model.recurrent(hidden, meta, cache)
        hidden = out.hidden
        logits.append(model.coda(hidden).float())
        if out.hazard is not None:
            hazards.append(out.hazard.float())
    return torch.stack(logits), (torch.stack(hazards) if hazards else None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(KNOWN / "ouro-1.4b" / "config.json"))
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    workdir = Path(tempfile.mkdtemp())
    shutil.copy(args.config, workdir / "config.json")
    t0 = time.perf_counter()
    model = load_model(workdir, dtype=torch.bfloat16, device=device, load_format="dummy")
    load_s = time.perf_counter() - t0
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).to(device)

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    logits, hazards = module_per_depth(model, ids)
    peak_module = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0

    state = {k: v.float() for k, v in model.state_dict().items()}
    ref = reference_forward(state, cfg, ids)
    per_depth = []
    for d in range(cfg.num_loops):
        err = (logits[d] - ref.logits[d]).abs()
        row = {
            "depth": d + 1,
            "max_rel_err_logits": float(err.max() / ref.logits[d].abs().max()),
            "mean_abs_err_logits": float(err.mean()),
            "top1_agreement": float(
                (logits[d].argmax(-1) == ref.logits[d].argmax(-1)).float().mean()
            ),
        }
        if hazards is not None:
            row["max_abs_err_hazard"] = float((hazards[d] - ref.hazards[d]).abs().max())
        per_depth.append(row)
    del state

    prompt = ids.tolist()[:16]
    ours, _ = greedy_decode(model, prompt, args.decode_tokens)
    model_fp32 = {k: v.float() for k, v in model.state_dict().items()}
    theirs, _ = reference_greedy(model_fp32, cfg, prompt, args.decode_tokens)
    pairs = enumerate(zip(ours, theirs, strict=True))
    agree = next((i for i, (a, b) in pairs if a != b), len(ours))

    result = {
        "model_config": Path(args.config).name,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "prompt_len": args.prompt_len,
        "dummy_load_seconds": round(load_s, 2),
        "per_depth": per_depth,
        "greedy_prefix_agreement": f"{agree}/{len(ours)}",
        "peak_gpu_mib_bf16_modules": round(peak_module / 2**20, 1),
        "peak_gpu_mib_total_with_fp32_oracle": round(
            (torch.cuda.max_memory_allocated() if device.type == "cuda" else 0) / 2**20, 1
        ),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
