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


# tokenizer_config.json classes that are the generic tokenizers-backed class itself: these load
# through it directly, without AutoTokenizer's class lookup (which imports the registry of every
# model in transformers, about half a second of start-up).
_GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
# transformers' "no limit" value: the engine checks prompts against the model's context itself,
# so the tokenizer's own "Token indices sequence length is longer than..." warning is noise.
_NO_LENGTH_LIMIT = int(1e30)


class TokenizerError(ValueError):
    """A tokenizer that is missing, unloadable, or cannot do what was asked (e.g. no template)."""


def has_tokenizer_files(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds any tokenizer file (a checkpoint with none runs on token ids)."""
    path = Path(model_dir)
    return path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local checkpoint directory, offline and without remote code.

    Its `model_max_length` is lifted: the engine enforces the model's context with its own error.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise TokenizerError(f"model directory {model_dir} does not exist")
    if not has_tokenizer_files(path):
        raise TokenizerError(
            f"no tokenizer files in {model_dir} (expected one of {', '.join(TOKENIZER_FILES)})"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = _from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TokenizerError(f"cannot load the tokenizer in {model_dir}: {_one_line(exc)}") from exc
    except Exception as exc:  # the tokenizers library's own errors (e.g. a garbage tokenizer.json)
        if type(exc).__module__.split(".")[0] not in ("tokenizers", "builtins"):
            raise
        raise TokenizerError(f"cannot load the tokenizer in {model_dir}: {_one_line(exc)}") from exc
    tokenizer.model_max_length = _NO_LENGTH_LIMIT
    return tokenizer


def _from_pretrained(path: Path) -> PreTrainedTokenizerBase:
    if (path / "tokenizer.json").is_file() and _config_class(path) in _GENERIC_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    from transformers import AutoTokenizer, PretrainedConfig

    return AutoTokenizer.from_pretrained(
        str(path),
        # An empty config keeps transformers from parsing config.json (and its auto_map):
        # the tokenizer class then comes from tokenizer_config.json / tokenizer.json.
        config=PretrainedConfig(),
        trust_remote_code=False,
        local_files_only=True,
    )


def _config_class(path: Path) -> str | None:
    """tokenizer_config.json's `tokenizer_class`, when it has no remote-code `auto_map`."""
    import json

    try:
        raw = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict) or raw.get("auto_map"):
        return None
    value = raw.get("tokenizer_class")
    return value if isinstance(value, str) else None


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render_chat_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The chat rendered by the model's own template, as text. `continue_final_message`: the
    last message is left open (no end-of-turn after it), for the model to go on with it."""
    if not getattr(tokenizer, "chat_template", None):
        raise TokenizerError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template: "
            "use plain prompts (completions) instead of chat messages"
        )
    _check_messages(messages)
    if continue_final_message and add_generation_prompt:
        raise TokenizerError("continue_final_message needs add_generation_prompt false")
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except ValueError as exc:  # e.g. the final message's text is not in the rendered chat
        raise TokenizerError(_one_line(exc)) from None
    if not isinstance(text, str):  # defensive: some versions return a list for batched input
        raise TokenizerError(f"chat template rendered {type(text).__name__}, expected str")
    return text


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """Token ids of a chat: template -> text -> ids, adding no special tokens of our own."""
    text = render_chat_text(
        tokenizer,
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
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
