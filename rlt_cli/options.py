"""Typer flags generated from the engine's config dataclasses and from `SamplingParams`.

Every engine flag `--foo-bar` is `LLM(foo_bar=...)` and every sampling flag is the
`SamplingParams` field of the same name, by construction: the flags are built from the dataclass
fields, so a new field becomes a new flag. Only the help texts live here. Torch-free.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import MISSING, Field, fields
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

import typer

from rlt_engine.config import CacheConfig, ExecutionConfig, ModelConfig, SchedulerConfig
from rlt_engine.sampling_params import SamplingParams

ENGINE_CLASSES: tuple[type, ...] = (ModelConfig, CacheConfig, SchedulerConfig, ExecutionConfig)
# SamplingParams fields with no CLI flag: a queue priority, a map of token ids, a grammar
NOT_FLAGS = frozenset({"priority", "logit_bias", "structured"})
LOOP_FIELDS = frozenset({"min_loops", "max_loops", "exit_threshold"})

HELP: dict[str, str] = {
    # engine (ModelConfig, CacheConfig, SchedulerConfig)
    "model": "Alias (ouro, nanbeige, ...), local directory or org/name. "
    "Default: a downloaded Ouro, else the bundled demo model.",
    "revision": "Hub branch, tag or commit (default: the alias's pinned commit).",
    "dtype": "auto, float32, bfloat16 or float16 (auto: bfloat16 on CUDA, float32 on CPU).",
    "device": "auto, cpu, cuda or cuda:N (auto: cuda when available).",
    "load_format": "auto, safetensors or dummy (random weights from the real config).",
    "max_model_len": "Context a request may use, in positions: its prompt + max_tokens - 1 (the "
    "last sampled token is never run). Default: the model's max_position_embeddings; a "
    "smaller one also shrinks RoPE's table and the KV one request can reserve.",
    "block_size": "Tokens per KV-cache block.",
    "num_blocks": "KV-cache blocks in the pool, all planes together (default: automatic).",
    "kv_layout": "last_exited (exact, one KV plane per loop) or shared (one plane, "
    "approximate, 1/D the memory).",
    "enable_prefix_caching": "Reuse the KV of shared prompt prefixes (last_exited only).",
    "incremental_kv": "Grow KV pages as requests advance (--no-incremental-kv: reserve each "
    "request's whole length at admission).",
    "watermark": "With --incremental-kv: share of blocks kept free when admitting.",
    "kv_cache_memory": "KV-cache size in bytes (overrides automatic sizing).",
    "gpu_memory_utilization": "CUDA: share of GPU memory the engine may use (model, "
    "activations and KV cache).",
    "scheduling_policy": "fcfs or priority (lower SamplingParams.priority first).",
    "enable_preemption": "On memory pressure or priority, snapshot a request to CPU memory "
    "and restore it exactly later.",
    "max_bypass": "Priority policy: times a waiting request may be overtaken before it is "
    "promoted.",
    "max_num_seqs": "Most requests running at once.",
    "max_num_batched_tokens": "Most rows in one batch (one traversal of the shared stack).",
    "prefill_chunk_size": "Most prompt tokens of one request per prefill step.",
    "refill": "Refill: a finished row is replaced at once. No-refill: a decode cohort runs "
    "until all its tokens exit.",
    "attention_backend": "auto, torch, triton or flash (auto: triton on CUDA, torch on CPU); "
    "an explicit choice that cannot run is an error.",
    "enforce_eager": "Run decode eagerly, without CUDA graphs.",
    "decode_window": "Decode traversals per engine step (one read back per window).",
    "async_scheduling": "Plan the next decode window while the current one runs (results "
    "one window late; exact). Default: on with CUDA, off on the CPU.",
    # sampling (SamplingParams)
    "max_tokens": "Most tokens to generate per prompt.",
    "min_tokens": "Least tokens to generate per prompt: no stop token id or stop string ends "
    "the first N.",
    "temperature": "Sampling temperature; 0 = greedy.",
    "top_k": "Keep the k most likely tokens; 0 = off.",
    "top_p": "Nucleus sampling mass, in (0, 1].",
    "seed": "Per-request sampling seed (results do not depend on the batch).",
    "ignore_eos": "Keep generating past EOS and the chat end token.",
    "stop": "Stop at this string, which is left out of the text (repeatable).",
    "stop_token_ids": "Also stop at this token id (repeatable).",
    "include_stop_str_in_output": "Keep the stop string that ended the text in it.",
    "skip_special_tokens": "Leave special tokens out of the text (--no-skip-special-tokens: "
    "keep them).",
    "logprobs": "Record the chosen token's logprob plus the top N (0 to 20).",
    "prompt_logprobs": "Record each prompt token's logprob (given the tokens before it, at full "
    "depth) plus the top N (0 to 20).",
    "presence_penalty": "Subtract this from the logit of every token already in the output, "
    "in [-2, 2]; 0 = off.",
    "frequency_penalty": "Subtract this times its count in the output from each token's logit, "
    "in [-2, 2]; 0 = off.",
    "repetition_penalty": "Divide the positive logits (multiply the negative ones) of tokens in "
    "the prompt or output by this, > 0; 1 = off.",
    "min_loops": "Least loops per token before it may exit (default 1).",
    "max_loops": "Most loops per generated token (default: the model depth); the prompt, "
    "and so the first token, always runs the full depth.",
    "exit_threshold": "Exit once the gate's cumulative exit probability reaches this, in 0..1; "
    "1 = fixed depth (default: the model config's).",
}


def engine_fields() -> list[Field[Any]]:
    return [f for cls in ENGINE_CLASSES for f in fields(cls)]


def sampling_fields() -> list[Field[Any]]:
    return [f for f in fields(SamplingParams) if f.name not in NOT_FLAGS]


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def engine_parameters() -> list[inspect.Parameter]:
    return [
        _parameter(f, get_type_hints(cls)[f.name], "Engine")
        for cls in ENGINE_CLASSES
        for f in fields(cls)
    ]


def sampling_parameters() -> list[inspect.Parameter]:
    hints = get_type_hints(SamplingParams)
    return [
        _parameter(f, hints[f.name], "Loop controls" if f.name in LOOP_FIELDS else "Sampling")
        for f in sampling_fields()
    ]


def to_field_values(values: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The parsed flags for these fields; flags not given (None, or a repeatable flag given zero
    times) are left out, so the dataclass default applies."""
    out = {}
    for name in names:
        value = values[name]
        if isinstance(value, (list, tuple)):
            value = tuple(value) or None
        if value is not None:
            out[name] = value
    return out


def dataclass_parameters(cls: type, panel: str, help: dict[str, str]) -> list[inspect.Parameter]:
    """One flag per field of a config dataclass other than the engine's (e.g. the server's)."""
    hints = get_type_hints(cls)
    return [_parameter(f, hints[f.name], panel, help.get(f.name, "")) for f in fields(cls)]


def _parameter(
    field: Field[Any], hint: Any, panel: str, help: str | None = None, default: Any = MISSING
) -> inspect.Parameter:
    """One keyword-only parameter `name: Annotated[type, typer.Option(...)] = default` (the
    field's default unless `default` is given)."""
    base, optional = _unwrap_optional(hint)
    if default is MISSING:
        default = field.default if field.default is not MISSING else None
    if get_origin(base) is tuple:  # tuple[X, ...] -> a repeatable flag
        item = get_args(base)[0]
        annotation: Any = list[item] | None  # type: ignore[valid-type]
        default = None
    else:
        annotation = base | None if optional else base
    flag = flag_name(field.name)
    if base is bool and default in (True, None):  # on by default, or decided by the engine
        flag = f"{flag}/--no-{flag[2:]}"
    text = HELP.get(field.name, "") if help is None else help
    option = typer.Option(flag, help=text, rich_help_panel=panel)
    return inspect.Parameter(
        field.name,
        inspect.Parameter.KEYWORD_ONLY,
        default=default,
        annotation=Annotated[annotation, option],
    )


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """(X, True) for `X | None`, else (hint, False)."""
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False
