"""Incremental detokenization and stop strings.

Text is only emitted once it is final: a token that ends inside a multi-byte character
decodes to U+FFFD and is held back until the following tokens complete it, and the last
characters that could still be the start of a stop string are held back until they cannot.
As vLLM, stop strings are looked for only once the output is longer than `min_tokens`, and
then only in the text the newest token adds (with what a stop string may straddle): one that
ended within the first `min_tokens` tokens is never found.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_WINDOW = 8  # most tokens decoded per push
_ANCHOR = 4  # tokens kept as context when the window is re-anchored


def text_decoder(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """`ids -> text`, without special tokens unless asked. A tokenizers-backed transformers
    tokenizer that does no clean-up decodes through its Rust tokenizer directly: the same text
    as its `decode`, without the Python wrapper that costs about half of each call (the host
    decodes every output token, so at 256 running requests this is on the critical path)."""
    skip = skip_special_tokens
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip)


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    include_stop: bool = False  # the text keeps the stop string that ended it (vLLM's)
    skip_special_tokens: bool = True
    text: str = ""
    _ids: list[int] = field(default_factory=list)
    _prefix: int = 0  # tokens before this index are already final text
    _prefix_text: str = ""
    _emitted: int = 0  # characters of `text` already handed out

    def __post_init__(self) -> None:
        self._decode = text_decoder(self.tokenizer, self.skip_special_tokens)

    def push(self, token_id: int) -> bool:
        """Add one token; True when the text now contains a stop string (it is cut there)."""
        self._ids.append(token_id)
        window = self._decode(self._ids[self._prefix :])
        if window.endswith("\ufffd"):
            return False  # incomplete UTF-8 sequence: wait for the next token
        new = window[len(self._prefix_text) :] if window.startswith(self._prefix_text) else window
        if len(self._ids) - self._prefix > _WINDOW:
            # Re-anchor on the last few tokens so each decode stays short on long outputs
            # (a second decode, once every few tokens).
            self._prefix = len(self._ids) - _ANCHOR
            self._prefix_text = self._decode(self._ids[self._prefix :])
        else:
            self._prefix_text = window
        return self._append(new)

    def _append(self, new: str) -> bool:
        before = len(self.text)
        self.text += new
        if not self.stop or len(self._ids) <= self.min_tokens:
            return False
        # a stop string may straddle the previous text and the new piece
        search_from = max(0, before - max(len(s) for s in self.stop) + 1)
        hits = [(i, len(s)) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            at, length = min(hits)  # the first to start (of those, the shortest)
            self.text = self.text[: at + length if self.include_stop else at]
            return True
        return False

    def take_new(self, final: bool = False) -> str:
        """Text that can no longer change; everything once the request is finished."""
        end = len(self.text)
        if not final and self.stop:
            end = max(self._emitted, end - max(len(s) for s in self.stop) + 1)
        piece = self.text[self._emitted : end]
        self._emitted = end
        return piece
