"""Structured output on the host: each constrained request's grammar matcher (xgrammar, as in
vLLM and SGLang) and the bitmask of the tokens its next token may be.

The device draws every token of a constrained row from the last mask the host sent it, and
then holds the row until the host, having seen the token, sends the next mask (the plan's
`MaskUpdate`): so a constrained row emits at most one token per window. A mask is the
little-endian int32 words of xgrammar's bitmask as bytes (bit t % 32 of word t // 32 set:
token t allowed), `mask_words(vocab)` words, plain bytes so that plans stay free of tensors.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from rlt_engine.sampling_params import StructuredOutput


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarError(ValueError):
    """A grammar, schema or regex that does not compile."""


class Grammars:
    """Compiles the grammars of one tokenizer and vocabulary (the model's, which may be wider
    than the tokenizer's: the extra ids are never allowed); compiled grammars are cached."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgrammar.GrammarCompiler(info)

    def matcher(self, spec: StructuredOutput, stop_token_ids: list[int]) -> Matcher:
        """A matcher at the start of the output; the grammar's end lets only
        `stop_token_ids` (the request's) through."""
        if not stop_token_ids:
            raise ValueError(
                "structured output needs a stop token to end on: drop ignore_eos or give "
                "stop_token_ids"
            )
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            # xgrammar's C++ messages start "[time] file.cc:line: "
            reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip().splitlines()[0])
            raise GrammarError(f"the {spec.kind} does not compile: {reason}") from None
        matcher = self._xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids))
        return Matcher(matcher, self.vocab_size)

    def _compile(self, spec: StructuredOutput) -> Any:
        c = self._compiler
        # compact JSON (no free whitespace between tokens): a weak model may otherwise pad
        # with spaces up to its max_tokens; the text is the same JSON
        if spec.json is not None:
            return c.compile_json_schema(spec.json, any_whitespace=False)
        if spec.json_object:  # OpenAI's json_object: an object, not any JSON value
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            # one alternative per string, each an EBNF string literal
            literals = " | ".join(_ebnf_literal(choice) for choice in spec.choice)
            return c.compile_grammar(f"root ::= {literals}")
        assert spec.grammar is not None
        return c.compile_grammar(spec.grammar)


class Matcher:
    """One request's grammar state: `mask()` for its next token, `accept(token)` after it."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._bitmask = np.zeros((1, mask_words(vocab_size)), dtype=np.int32)

    def mask(self) -> bytes:
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        return self._bitmask.astype("<i4", copy=False).tobytes()

    def accept(self, token_id: int) -> None:
        """Advance past `token_id`, which the last mask allowed (the device drew it from that
        mask); a token it refuses means the mask and the matcher disagree: a bug."""
        if not self._matcher.accept_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}, which its mask allowed")


def _ebnf_literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return '"' + escaped.replace("\r", "\\r").replace("\t", "\\t") + '"'
