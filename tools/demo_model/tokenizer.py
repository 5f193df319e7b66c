"""The demo model's tokenizer: byte-level BPE trained on the training text, saved in the
Hugging Face layout that Ouro ships (tokenizer.json, tokenizer_config.json with the ChatML
template, special_tokens_map.json)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .data import EOS, SPECIAL_TOKENS

# Ouro-1.4B's ChatML template, verbatim.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' and loop.first -%}{# Skip #}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def tokenizer_training_text(docs: Sequence[str]) -> Iterator[str]:
    """Documents without special tokens: BPE merges must never span `<|...|>` markers."""
    pattern = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    for doc in docs:
        yield from (piece for piece in pattern.split(doc) if piece)


def train_tokenizer(docs: Sequence[str], vocab_size: int) -> Any:
    """Byte-level BPE like Ouro's: digits split one by one, no prefix space, specials 0..2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),  # first, so they get ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_training_text(docs), trainer=trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != i:
            raise RuntimeError(f"special token {token} did not get id {i}")
    return tok


def save_tokenizer(tok: Any, out: Path, max_length: int) -> None:
    """HF layout as Ouro ships it: tokenizer.json, tokenizer_config.json (ChatML template
    inline) and special_tokens_map.json. Written by hand rather than by `save_pretrained`, whose
    output differs between transformers 4 and 5 (class name, template file): these files load
    with either through `load_tokenizer` (AutoTokenizer, offline)."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS),
        "bos_token": EOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "extra_special_tokens": {},
        "model_max_length": max_length,
        "pad_token": EOS,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": EOS,
    }
    write_json(out / "tokenizer_config.json", config)
    special = {name: _special(EOS) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    write_json(
        out / "special_tokens_map.json",
        {"additional_special_tokens": list(SPECIAL_TOKENS), **special},
    )


def _special(content: str) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    }


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def load_saved_tokenizer(out: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(out / "tokenizer.json"))
