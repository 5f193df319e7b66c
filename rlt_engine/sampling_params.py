"""Per-request generation controls (pure Python; validated at construction)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain the output to a grammar: exactly one of a JSON schema (`json`, a dict or its
    JSON text), any JSON object (`json_object`), a regular expression, a choice among strings,
    or an EBNF grammar (xgrammar's dialect, root rule `root`). vLLM's `structured_outputs`."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):  # kept as canonical text: the params stay hashable
            object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured output takes exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}"
            )

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k))


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    # the first min_tokens tokens can be no stop token id (their logits are set to -inf) and end
    # no stop string (vLLM's)
    min_tokens: int = 0
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None  # None = the model's EOS + chat end token
    include_stop_str_in_output: bool = False  # the text keeps the stop string (vLLM's)
    skip_special_tokens: bool = True  # the text leaves special tokens out (vLLM's)
    logprobs: int | None = None  # None = off; n = chosen token + top-n
    # vLLM's: each prompt token's logprob given the tokens before it (the first has none),
    # + top-n, from the model's full depth; None = off. Its prompt is computed, never a
    # prefix-cache hit, and its prefill never rides a decode window.
    prompt_logprobs: int | None = None
    # OpenAI's and vLLM's penalties, applied to the logits before temperature and the
    # filters (logprobs stay those of the raw logits): repetition divides a positive logit
    # (multiplies a negative one) of every token seen in the prompt or the output; then
    # frequency x (times in the output) and presence x (in the output at all) are subtracted
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> added to its logit before the penalties, in [-100, 100] (OpenAI's): given as
    # a dict, kept as sorted (id, bias) pairs
    logit_bias: tuple[tuple[int, float], ...] = ()
    # the output follows this grammar: each token is drawn from those it allows (a bitmask
    # the host computes after the previous one); None = free text
    structured: StructuredOutput | None = None
    # Loop controls; None = model defaults (1, depth, config's early_exit_threshold).
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r} "
                f"(max_tokens={self.max_tokens})"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must lie in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must lie in [0, 20], got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must lie in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got "
                f"{self.repetition_penalty}"
            )
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens")
        if len({t for t, _ in self.logit_bias}) < len(self.logit_bias):
            raise ValueError("logit_bias names a token twice")
        for t, b in self.logit_bias:
            if t < 0 or not (math.isfinite(b) and -100.0 <= b <= 100.0):
                raise ValueError(
                    f"logit_bias must map token ids >= 0 to biases in [-100, 100], got {t}: {b}"
                )
        if isinstance(self.structured, dict):
            object.__setattr__(self, "structured", StructuredOutput(**self.structured))
        if self.structured is not None and self.min_tokens:
            # a grammar that is complete lets only stop tokens through, which min_tokens holds
            # back: nothing would be left to draw
            raise ValueError("min_tokens cannot be combined with structured output")
        if any(not s for s in self.stop):
            raise ValueError("stop must not hold an empty string (it would match at once)")
        if self.min_loops is not None and self.min_loops < 1:
            raise ValueError(f"min_loops must be >= 1, got {self.min_loops}")
        if self.max_loops is not None and self.max_loops < 1:
            raise ValueError(f"max_loops must be >= 1, got {self.max_loops}")
        if self.exit_threshold is not None and not 0.0 <= self.exit_threshold <= 1.0:
            raise ValueError(f"exit_threshold must lie in [0, 1], got {self.exit_threshold}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def edits_logits(self) -> bool:
        """Whether a penalty, a logit bias, min_tokens or a grammar changes the logits (the
        sampler's `logit_edits` variant)."""
        return (
            self.penalized
            or bool(self.logit_bias)
            or self.holds_back_stops
            or self.structured is not None
        )

    @property
    def holds_back_stops(self) -> bool:
        """Whether min_tokens holds back any stop token id: with ignore_eos and no
        stop_token_ids the request has none."""
        return self.min_tokens > 0 and not (self.ignore_eos and not self.stop_token_ids)

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
