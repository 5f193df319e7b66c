"""The offline Python API: `LLM(model, **engine options).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rlt_engine.config import EngineConfig
from rlt_engine.engine import LLMEngine
from rlt_engine.engine_info import EngineInfo
from rlt_engine.outputs import RequestOutput
from rlt_engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """`LLM(model=None)` runs the bundled demo model; any `EngineConfig` field is a keyword."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_options(model=model, **options))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def info(self) -> EngineInfo:
        """What was loaded and how it runs (model, device, KV pool, backends, defaults)."""
        return self.engine.info

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts as one batch; outputs come back in input order.

        `on_output` sees every incremental output (for streaming front ends).
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(self.engine.add_request(prompt, p))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(ids):
                for out in self.engine.step():
                    if on_output is not None:
                        on_output(out)
                    if out.finished:
                        final[out.request_id] = out
            self.engine.settle()  # the finished requests' slots freed on the device too
        except BaseException:
            for rid in ids:  # a failed step or Ctrl-C: free whatever this call still holds
                if rid not in final:
                    self.engine.abort_request(rid)
            raise
        return [final[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, rendered with the chat template
        (`continue_final_message`: the last message left open, for the answer to go on with
        it; it needs add_generation_prompt=False)."""
        from rlt_engine.models.tokenizer import render_chat

        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            render_chat(
                self.tokenizer,
                conv,  # type: ignore[arg-type]
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
            for conv in conversations
        ]
        return self.generate(prompts, params, **kwargs)
