"""The model class implementing each `model_type` (torch is imported only when asked)."""

from __future__ import annotations


def model_class(model_type: str) -> type:
    """The torch module class implementing `model_type` (imports torch lazily)."""
    if model_type == "ouro":
        from rlt_engine.models.ouro import OuroForCausalLM

        return OuroForCausalLM
    if model_type == "nanbeige":
        from rlt_engine.models.nanbeige import NanbeigeForCausalLM

        return NanbeigeForCausalLM
    raise ValueError(f"no model implementation for model_type {model_type!r}")
