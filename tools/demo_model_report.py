"""Evidence for the demo model card: held-out loss per loop depth, exit-depth histograms,
easy-versus-hard tokens, and greedy continuations. CPU, fp32, a minute or two.

Every number comes from the product's own code paths: `load_model` / `load_tokenizer`, the
model modules (every loop run over whole sequences, as in training), `exit_hazard`, the fp32
exit rule of `rlt_engine.core.exit_rule` and `contiguous_kv.greedy_decode`.

Exit depths here are per token under teacher forcing: each token's hazards come from a
full-depth pass over its true context. (In generation, a token that exits early lends its last
K/V to deeper loops, so later tokens' hazards can differ slightly.)

    python tools/demo_model_report.py --model rlt_engine/assets/ouro-gsm8k-tiny --out report.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TOOLS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TOOLS_DIR.parent
for _path in (TOOLS_DIR, REPO_ROOT):  # run as a script from a source checkout
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from demo_model.backend import CausalSDPABackend, loop_hiddens  # noqa: E402
from demo_model.data import EOS, clean_answer, default_data_dir, load_problems, plain_document  # noqa: E402

from rlt_engine.checkpoints.loader import load_model  # noqa: E402
from rlt_engine.core.exit_rule import ExitTracker, LoopControls  # noqa: E402
from rlt_engine.models.base import LoopedCausalLM  # noqa: E402
from rlt_engine.models.tokenizer import load_tokenizer  # noqa: E402
from rlt_engine.oracle.contiguous_kv import greedy_decode  # noqa: E402

THRESHOLDS = (0.5, 0.7, 0.9)


@dataclass
class TokenScores:
    ce: torch.Tensor  # [loops, tokens] fp32 cross-entropy of each loop's read-out
    hazards: torch.Tensor  # [loops, tokens] fp32 exit hazards
    is_digit: torch.Tensor  # [tokens] bool: the target token is a digit


def prompt_text(question: str) -> str:
    """The training format up to the answer: what a user would type to the demo model."""
    return plain_document(question, "").removesuffix(EOS).rstrip()


@torch.no_grad()
def score_documents(
    model: LoopedCausalLM, docs: Sequence[list[int]], batch_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token CE and hazards of every loop for each document, concatenated over documents.

    Documents are right-padded into batches; causal attention keeps padding out of the real
    tokens, and padded positions are dropped before anything is counted."""
    backend = CausalSDPABackend()
    ce_parts, hazard_parts = [], []
    for start in range(0, len(docs), batch_size):
        chunk = docs[start : start + batch_size]
        width = max(len(d) for d in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, doc in enumerate(chunk):
            ids[i, : len(doc)] = torch.tensor(doc)
        valid = (
            torch.arange(width - 1)[None, :] < torch.tensor([len(d) - 1 for d in chunk])[:, None]
        ).reshape(-1)
        hiddens = loop_hiddens(model, ids[:, :-1], backend)
        targets = ids[:, 1:].reshape(-1)
        ce = torch.stack(
            [
                torch.nn.functional.cross_entropy(model.coda(h).float(), targets, reduction="none")
                for h in hiddens
            ]
        )
        hazards = torch.stack([model.exit_hazard(h) for h in hiddens])
        ce_parts.append(ce[:, valid])
        hazard_parts.append(hazards[:, valid])
    return torch.cat(ce_parts, 1), torch.cat(hazard_parts, 1)


def score_problems(
    model: LoopedCausalLM, tokenizer: Any, problems: Sequence[dict[str, str]]
) -> TokenScores:
    # A leading <|endoftext|>: in the packed training stream every document follows one.
    docs = [[0, *tokenizer.encode(plain_document(**p), add_special_tokens=False)] for p in problems]
    ce, hazards = score_documents(model, docs)
    targets = [t for d in docs for t in d[1:]]
    digit_ids = {i for tok, i in tokenizer.get_vocab().items() if tok.isdigit()}
    is_digit = torch.tensor([t in digit_ids for t in targets])
    return TokenScores(ce=ce, hazards=hazards, is_digit=is_digit)


def exit_depths(hazards: torch.Tensor, threshold: float) -> torch.Tensor:
    """Each token's depth under the product's fp32 exit rule (min_loops 1, max_loops D)."""
    loops = hazards.shape[0]
    controls = LoopControls(1, loops, threshold)
    depths = []
    for column in hazards.T.tolist():
        tracker = ExitTracker(controls)
        for hazard in column:
            if tracker.step(hazard):
                break
        depths.append(tracker.loops_done)
    return torch.tensor(depths)


def exit_summary(scores: TokenScores, threshold: float) -> dict[str, Any]:
    depths = exit_depths(scores.hazards, threshold)
    loops = scores.ce.shape[0]
    counts = torch.bincount(depths - 1, minlength=loops)
    exited_ce = scores.ce.gather(0, (depths - 1)[None, :]).squeeze(0)
    return {
        "threshold": threshold,
        "histogram": {str(d + 1): int(c) for d, c in enumerate(counts)},
        "fraction": [round(float(c) / depths.numel(), 4) for c in counts],
        "mean_depth": round(float(depths.float().mean()), 4),
        "ce_at_exit": round(float(exited_ce.mean()), 4),
        "ce_full_depth": round(float(scores.ce[-1].mean()), 4),
        "depths": depths,
    }


def easy_vs_hard(scores: TokenScores, summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean exit depth by quartile of the full-depth CE (easy = low CE), and for digit tokens
    (the arithmetic) versus the rest."""
    final = scores.ce[-1]
    edges = torch.quantile(final, torch.tensor([0.25, 0.5, 0.75]))
    quartile = torch.bucketize(final, edges)
    groups: dict[str, torch.Tensor] = {f"ce_quartile_{q + 1}": quartile == q for q in range(4)}
    groups["digit_tokens"] = scores.is_digit
    groups["other_tokens"] = ~scores.is_digit
    out: dict[str, Any] = {"ce_quartile_edges": [round(float(e), 4) for e in edges]}
    for name, mask in groups.items():
        out[name] = {
            "tokens": int(mask.sum()),
            "mean_ce_full_depth": round(float(final[mask].mean()), 4),
            "ce_gain_loop1_to_4": round(float((scores.ce[0] - final)[mask].mean()), 4),
            "mean_exit_depth": {
                str(s["threshold"]): round(float(s["depths"][mask].float().mean()), 3)
                for s in summaries
            },
        }
    return out


def continuation(
    model: LoopedCausalLM, tokenizer: Any, question: str, max_new_tokens: int, threshold: float
) -> dict[str, Any]:
    prompt = prompt_text(question)
    ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    out: dict[str, Any] = {"prompt": prompt}
    for name, controls in (
        ("full_depth", None),
        (f"exit_{threshold}", LoopControls(1, model.num_loops, threshold)),
    ):
        tokens, depths = greedy_decode(model, ids, max_new_tokens, controls)
        if 0 in tokens:  # stop at <|endoftext|>
            cut = tokens.index(0)
            tokens, depths = tokens[:cut], depths[:cut]
        out[name] = {
            "text": tokenizer.decode(tokens, skip_special_tokens=True),
            "tokens": len(tokens),
            "mean_depth": round(sum(depths) / max(1, len(depths)), 3),
        }
    return out


def build_report(
    model_dir: Path, data_dir: Path, problems: int, samples: int, max_new_tokens: int
) -> dict[str, Any]:
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = load_model(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(model_dir)
    test = load_problems(data_dir / "test.jsonl")
    scores = score_problems(model, tokenizer, test[:problems])
    summaries = [exit_summary(scores, t) for t in THRESHOLDS]
    report: dict[str, Any] = {
        "model": str(model_dir),
        "parameters": sum(p.numel() for p in model.parameters()),
        "files_bytes": {
            f.name: f.stat().st_size for f in sorted(model_dir.iterdir()) if f.is_file()
        },
        "heldout": {
            "data": f"GSM8K test, first {problems} problems",
            "tokens": int(scores.ce.shape[1]),
            "ce_per_loop": [round(float(x), 4) for x in scores.ce.mean(1)],
        },
        "exit": [{k: v for k, v in s.items() if k != "depths"} for s in summaries],
        "easy_vs_hard": easy_vs_hard(scores, summaries),
        "samples": [],
    }
    for i, pr in enumerate(test[:samples]):
        sample = continuation(model, tokenizer, pr["question"], max_new_tokens, 0.7)
        sample["reference"] = clean_answer(pr["answer"])
        sample["index"] = i
        report["samples"].append(sample)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def markdown(report: dict[str, Any]) -> str:
    lines = [f"### Demo model report ({report['model']})", ""]
    lines.append(
        f"Parameters: {report['parameters']:,}. {report['heldout']['data']}, "
        f"{report['heldout']['tokens']:,} tokens."
    )
    lines += ["", "| loops | 1 | 2 | 3 | 4 |", "|---|---|---|---|---|"]
    ce = report["heldout"]["ce_per_loop"]
    lines.append("| held-out CE (nats) | " + " | ".join(f"{x:.3f}" for x in ce) + " |")
    lines += [
        "",
        "| exit threshold | depth 1 | depth 2 | depth 3 | depth 4 | mean depth | CE at exit | "
        "CE at depth 4 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in report["exit"]:
        fr = " | ".join(f"{100 * f:.1f}%" for f in s["fraction"])
        lines.append(
            f"| {s['threshold']} | {fr} | {s['mean_depth']:.2f} | {s['ce_at_exit']:.3f} | "
            f"{s['ce_full_depth']:.3f} |"
        )
    evh = report["easy_vs_hard"]
    lines += [
        "",
        "| tokens | count | CE at depth 4 | CE gain 1→4 | mean exit depth @0.5 / 0.7 / 0.9 |",
        "|---|---|---|---|---|",
    ]
    for name, g in evh.items():
        if name == "ce_quartile_edges":
            continue
        depths = " / ".join(f"{d:.2f}" for d in g["mean_exit_depth"].values())
        lines.append(
            f"| {name} | {g['tokens']:,} | {g['mean_ce_full_depth']:.3f} | "
            f"{g['ce_gain_loop1_to_4']:.3f} | {depths} |"
        )
    for s in report["samples"]:
        lines += ["", f"**Test problem {s['index']}** (greedy, depth 4):", "", "```"]
        lines += [s["prompt"] + " " + s["full_depth"]["text"].strip(), "```"]
        early = next(v for k, v in s.items() if k.startswith("exit_"))
        lines += [
            "",
            f"With exit threshold 0.7 (mean depth {early['mean_depth']:.2f}):",
            "",
            "```",
            early["text"].strip(),
            "```",
        ]
    lines += ["", f"Report took {report['seconds']} s."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO_ROOT / "rlt_engine/assets/ouro-gsm8k-tiny")
    p.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    p.add_argument("--data-dir", type=Path, default=None, help="folder with GSM8K test.jsonl")
    p.add_argument("--problems", type=int, default=200, help="test problems scored")
    p.add_argument("--samples", type=int, default=3, help="greedy continuations shown")
    p.add_argument("--max-new-tokens", type=int, default=100)
    args = p.parse_args(argv)
    report = build_report(
        args.model,
        args.data_dir or default_data_dir(),
        args.problems,
        args.samples,
        args.max_new_tokens,
    )
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
