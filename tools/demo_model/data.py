"""GSM8K train problems as training text, and that text as batches of token windows.

Each problem becomes one document, either "Question: ...\nAnswer: ..." or a ChatML chat exactly as
the saved chat template renders it, each ended by the end-of-text token.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]

# Ids 0, 1, 2 as in Ouro's vocabulary: bos = eos = 0, chat turns end with 2.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS = SPECIAL_TOKENS[0]
SYSTEM_PROMPT = "You are a helpful assistant."
CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")


def default_data_dir() -> Path:
    """GSM8K beside the checkout (../shared), else inside it (shared/), or $RLT_SHARED_DIR."""
    env = os.environ.get("RLT_SHARED_DIR")
    candidates = [Path(env)] if env else []
    candidates += [REPO_ROOT.parent / "shared", REPO_ROOT / "shared"]
    for base in candidates:
        if (base / "datasets" / "gsm8k" / "train.jsonl").is_file():
            return base / "datasets" / "gsm8k"
    return candidates[0] / "datasets" / "gsm8k"


def load_problems(path: Path, limit: int | None = None) -> list[dict[str, str]]:
    problems = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                problems.append({"question": row["question"], "answer": row["answer"]})
            if limit is not None and len(problems) >= limit:
                break
    return problems


def clean_answer(answer: str) -> str:
    """Drop the calculator annotations (`<<48/2=24>>`): they repeat the arithmetic written just
    before them, make the text longer, and are not what a reader (or the model) should emit."""
    return CALCULATOR_ANNOTATION.sub("", answer)


def plain_document(question: str, answer: str) -> str:
    return f"Question: {question}\nAnswer: {clean_answer(answer)}{EOS}"


def chat_document(question: str, answer: str) -> str:
    """The same problem as a ChatML chat exactly as `tokenizer.CHAT_TEMPLATE` renders it, so
    that chat requests to the demo model land on text it has seen."""
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n"
        f"<|im_start|>assistant\n{clean_answer(answer)}<|im_end|>\n{EOS}"
    )


def documents(problems: Sequence[dict[str, str]], chat_every: int) -> list[str]:
    """Training text: every `chat_every`-th problem as a chat, the rest as Question/Answer."""
    docs = []
    for i, pr in enumerate(problems):
        as_chat = chat_every > 0 and i % chat_every == chat_every - 1
        make = chat_document if as_chat else plain_document
        docs.append(make(pr["question"], pr["answer"]))
    return docs


def encode_documents(tok: Any, docs: Sequence[str]) -> list[torch.Tensor]:
    return [torch.tensor(e.ids, dtype=torch.long) for e in tok.encode_batch(list(docs))]


def epoch_windows(
    docs: Sequence[torch.Tensor], seq_len: int, seed: int, epoch: int
) -> torch.Tensor:
    """One epoch of training windows [n, seq_len + 1]: documents shuffled (seeded by epoch),
    concatenated, cut into windows, windows shuffled. Neighbouring windows share one token so
    every token is a target once."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(docs), generator=g).tolist()
    stream = torch.cat([docs[i] for i in order])
    n = (stream.numel() - 1) // seq_len
    windows = stream[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)
    return windows[torch.randperm(n, generator=g)]


def training_batches(
    docs: Sequence[torch.Tensor], seq_len: int, batch_size: int, seed: int
) -> Iterator[torch.Tensor]:
    """Endless deterministic stream of [batch_size, seq_len + 1] batches (epoch after epoch)."""
    epoch = 0
    while True:
        windows = epoch_windows(docs, seq_len, seed, epoch)
        if windows.shape[0] < batch_size:
            raise ValueError(f"{windows.shape[0]} windows are too few for batch {batch_size}")
        for i in range(0, windows.shape[0] - batch_size + 1, batch_size):
            yield windows[i : i + batch_size]
        epoch += 1
