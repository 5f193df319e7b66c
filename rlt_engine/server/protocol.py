"""Request bodies of the OpenAI-compatible API, as pydantic models, and their mapping onto
`SamplingParams`. Unknown fields are ignored (as OpenAI-compatible servers do); fields we know
but cannot honour with the value given are refused with a 400 naming the field. Among those:
tool calling (`tools` unless `tool_choice` is "none", `functions`): ignoring it would answer
free text where the client asked for a tool call (vLLM refuses tools likewise without a tool
parser).

Structured output: OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's
`structured_outputs` (`json`, `json_object`, `regex`, `choice`, `grammar`) and its older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`; one of them per request.

Looped-model extensions: `min_loops`, `max_loops`, `exit_threshold`, `priority`; every choice
returns its per-token exit depths as `exit_depths`. vLLM's: `top_k`, `ignore_eos`,
`stop_token_ids`, `repetition_penalty`, `min_tokens`, `include_stop_str_in_output`,
`skip_special_tokens`.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlt_engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams, StructuredOutput

MAX_LOGPROBS = 20
MAX_N = 16

NonNegativeInt = Annotated[int, Field(ge=0)]


class ParamError(ValueError):
    """A request field with a value we refuse; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)  # vLLM's
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: off
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM's
    skip_special_tokens: bool = True  # vLLM's
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    response_format: dict[str, object] | None = None
    structured_outputs: dict[str, object] | None = None  # vLLM's
    guided_json: dict[str, object] | str | None = None  # vLLM's older names
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None = None
    # looped-model extensions
    min_loops: int | None = Field(default=None, ge=1)
    max_loops: int | None = Field(default=None, ge=1)
    exit_threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    priority: int = 0
    repetition_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)  # vLLM's

    def _check_common(self) -> None:
        self.structured  # noqa: B018 (parsed here: a bad field is a 400 before any work)
        self.token_biases()
        stops = self.stop_strings()
        if any(not s for s in stops):
            raise ParamError("stop", "stop strings must be non-empty")
        if len(stops) > 16:
            raise ParamError("stop", "at most 16 stop strings")
        if self.min_loops and self.max_loops and self.min_loops > self.max_loops:
            raise ParamError("min_loops", "min_loops must be <= max_loops")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options needs stream: true")

    def token_biases(self) -> dict[int, float]:
        """`logit_bias` with its keys (token ids as JSON strings) as ints, checked."""
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise ParamError("logit_bias", f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens")
        try:
            ids = {int(t): b for t, b in bias.items()}
        except ValueError:
            raise ParamError("logit_bias", "logit_bias keys must be token ids") from None
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in ids.items()):
            raise ParamError("logit_bias", "logit_bias maps token ids to biases in [-100, 100]")
        return ids

    @cached_property
    def structured(self) -> tuple[str, StructuredOutput] | None:
        """(the field it came from, the grammar) of a request for structured output; parsed
        once per body (a refusal raises at every access)."""
        given: list[tuple[str, dict[str, object]]] = []
        rf = self.response_format
        if rf is not None and rf.get("type") != "text":
            given.append(("response_format", _response_format(rf)))
        if self.structured_outputs:
            given.append(("structured_outputs", dict(self.structured_outputs)))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                given.append((f"guided_{name}", {name: value}))
        if not given:
            return None
        field = given[0][0]
        if len(given) > 1:
            fields = ", ".join(f for f, _ in given)
            raise ParamError(field, f"structured output is asked for more than once ({fields})")
        spec = given[0][1]
        unknown = set(spec) - {"json", "json_object", "regex", "choice", "grammar"}
        if unknown:
            raise ParamError(field, f"{field} has unknown keys: {', '.join(sorted(unknown))}")
        try:
            return field, StructuredOutput(**spec)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise ParamError(field, f"{field}: {exc}") from None

    @property
    def grammar_field(self) -> str | None:
        """The field that asked for structured output, if one did."""
        return self.structured[0] if self.structured else None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, choice: int, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The engine parameters of choice `choice` (of n): seeded choices get seed + choice, so
        n > 1 with one seed gives n different, reproducible samples."""
        seed = None if self.seed is None else (self.seed + choice) % 2**63
        if self.min_tokens and self.structured:
            raise ParamError("min_tokens", "min_tokens cannot be combined with structured output")
        if self.min_tokens > max_tokens:
            raise ParamError(
                "min_tokens", f"min_tokens ({self.min_tokens}) exceeds max_tokens ({max_tokens})"
            )
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=self.temperature,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            seed=seed,
            ignore_eos=self.ignore_eos,
            stop=self.stop_strings(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            stop_token_ids=tuple(self.stop_token_ids) if self.stop_token_ids else None,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.token_biases(),
            structured=self.structured[1] if self.structured else None,
            min_loops=self.min_loops,
            max_loops=self.max_loops,
            exit_threshold=self.exit_threshold,
            priority=self.priority,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _response_format(rf: dict[str, object]) -> dict[str, object]:
    """OpenAI's response_format as StructuredOutput's fields."""
    kind = rf.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ParamError(
                "response_format", "response_format.json_schema.schema must be an object"
            )
        return {"json": schema}
    raise ParamError(
        "response_format", "response_format.type must be text, json_object or json_schema"
    )


Prompt = str | list[str] | list[NonNegativeInt] | list[list[NonNegativeInt]]


class CompletionRequest(_Common):
    prompt: Prompt
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions

    def check(self) -> None:
        self._check_common()
        if self.best_of not in (None, self.n):
            raise ParamError("best_of", "best_of is not supported (leave it unset or equal to n)")
        if self.suffix:
            raise ParamError("suffix", "suffix is not supported")

    @property
    def scored_prompt(self) -> int | None:
        """The engine's prompt_logprobs: vLLM's field, or echo with logprobs (the echoed
        prompt's tokens come with their logprobs too); the wider where both ask."""
        asked = [
            k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None
        ]
        return max(asked) if asked else None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ParamError("prompt", "the prompt is empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, object]] | None = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ParamError(f"messages.{index}.content", "only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last message left open, to go on with
    tools: list[dict[str, object]] | None = None
    tool_choice: str | dict[str, object] | None = None
    functions: list[dict[str, object]] | None = None

    def check(self) -> None:
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.tools and self.tool_choice != "none":
            raise ParamError(
                "tools", 'tool calling is not supported (send tool_choice: "none", or no tools)'
            )
        if self.functions:
            raise ParamError("functions", "function calling is not supported")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the model's template."""

    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ParamError("prompt", "give exactly one of prompt and messages")


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize."""

    model_config = ConfigDict(extra="ignore")

    model: str
    tokens: list[NonNegativeInt]
