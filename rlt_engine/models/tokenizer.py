"""Tokenizer loading, chat rendering and stop tokens.

Loading never executes a checkpoint's remote code and never touches the network: Ouro's
config.json carries an `auto_map` to hub `.py` files, and asking transformers to resolve it may
prompt interactively (and hang a CI job) or download code.

Chats are rendered to TEXT with the model's template and encoded with `add_special_tokens=False`.
The template already writes every special token the model expects; Nanbeige's tokenizer would
otherwise prepend a second BOS (`<|im_start|>`) in front of the template's own `<|im_start|>`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlt_engine.models.configs import LoopedLMConfig

# Any one of these makes a directory loadable by some tokenizer class of transformers.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

# End-of-turn / end-of-text tokens we always stop on when the vocabulary has them, in addition
# to the config's eos ids (Ouro: eos 0 `<|endoftext|>` plus `<|im_end|>` 2; Nanbeige: eos
# `<|im_end|>` 166101 plus `<|endoftext|>` 166102).
CHAT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


class TokenizerError(ValueError):
    """A tokenizer that is missing, unloadable, or cannot do what was asked (e.g. no template)."""


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local checkpoint directory, offline and without remote code."""
    path = Path(model_dir)
    if not path.is_dir():
        raise TokenizerError(f"model directory {model_dir} does not exist")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise TokenizerError(
            f"no tokenizer files in {model_dir} (expected one of {', '.join(TOKENIZER_FILES)})"
        )
    from transformers import AutoTokenizer, PretrainedConfig

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoTokenizer.from_pretrained(
                str(path),
                # An empty config keeps transformers from parsing config.json (and its auto_map):
                # the tokenizer class then comes from tokenizer_config.json / tokenizer.json.
                config=PretrainedConfig(),
                trust_remote_code=False,
                local_files_only=True,
            )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TokenizerError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc


def render_chat_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The chat rendered by the model's own template, as text."""
    if not getattr(tokenizer, "chat_template", None):
        raise TokenizerError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template: "
            "use plain prompts (completions) instead of chat messages"
        )
    _check_messages(messages)
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
    )
    if not isinstance(text, str):  # defensive: some versions return a list for batched input
        raise TokenizerError(f"chat template rendered {type(text).__name__}, expected str")
    return text


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of a chat: template -> text -> ids, adding no special tokens of our own."""
    text = render_chat_text(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if not messages:
        raise TokenizerError("a chat needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise TokenizerError(f"message {i} must be a mapping with 'role' and 'content'")


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, config: LoopedLMConfig) -> tuple[int, ...]:
    """Default stop ids: the config's eos ids, then the chat end tokens the vocabulary has."""
    candidates = [*config.eos_token_ids, *_vocab_ids(tokenizer, CHAT_STOP_TOKENS)]
    return tuple(_unique(t for t in candidates if 0 <= t < config.vocab_size))


def _vocab_ids(tokenizer: PreTrainedTokenizerBase, tokens: Iterable[str]) -> list[int]:
    vocab = tokenizer.get_vocab()
    return [vocab[token] for token in tokens if token in vocab]


def _unique(ids: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(int(i) for i in ids))
