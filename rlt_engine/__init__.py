"""rlt_engine: inference engine for looped (recurrent-depth) language models.

`from rlt_engine import LLM, SamplingParams` imports torch lazily, on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlt_engine.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from rlt_engine.engine import LLMEngine
    from rlt_engine.llm import LLM


def __getattr__(name: str) -> object:
    if name == "LLM":
        from rlt_engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from rlt_engine.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
