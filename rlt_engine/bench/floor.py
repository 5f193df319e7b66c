"""The weight-bandwidth floor of decode: how fast a token step could possibly be if
it did nothing but read the model's weights once per traversal at the device's copy bandwidth.

A token step gives every running request one more token. It traverses the shared layer stack
once per loop and runs the coda (final norm + lm_head) once, so it reads

    bytes per token step = loops x (layer-stack bytes) + coda bytes

(the embedding rows it gathers are a few KB and left out; so are KV-cache reads, which grow with
context and concurrency and make this floor optimistic at long contexts and large batches).
At a copy bandwidth of W bytes/s, c requests at once decode at most

    floor tokens/s = c / (bytes per token step / W)

and a measured rate is reported as a share of that. Bandwidth counts bytes read + bytes written
per second of a large device-to-device copy (the convention of CUDA's bandwidthTest).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class WeightBytes:
    """Weight bytes one token step reads (distinct bytes: shared or packed storage once)."""

    layer_stack: int  # one traversal: every layer, plus a per-loop norm and the exit gate
    coda: int  # once per token step: lm_head (and the final norm when it runs once)
    embedding_row: int  # per request and token step (not counted in the floor)

    def per_token_step(self, loops: float) -> float:
        return loops * self.layer_stack + self.coda


def weight_bytes(model: nn.Module) -> WeightBytes:
    """From a `LoopedCausalLM`: the traversal reads everything under `model.model` except the
    token embeddings (and the final norm when the coda applies it); the coda reads lm_head."""
    inner = model.model
    norm_every_loop = bool(getattr(model.config, "norm_every_loop", False))
    coda_modules = [model.lm_head] + ([] if norm_every_loop else [inner.norm])
    skip = {id(t) for t in _tensors([inner.embed_tokens, *coda_modules])}
    stack = [t for t in _tensors([inner]) if id(t) not in skip]
    coda = _tensors(coda_modules)
    embed = inner.embed_tokens.weight
    stack_bytes = _distinct_bytes(stack)
    coda_bytes = _distinct_bytes([*coda, *stack]) - stack_bytes  # tied weights: once
    return WeightBytes(stack_bytes, coda_bytes, embed.shape[-1] * embed.element_size())


def floor_tokens_per_s(concurrency: int, bytes_per_step: float, bandwidth: float) -> float:
    """Most tokens/s `concurrency` requests can decode when each token step reads
    `bytes_per_step` bytes at `bandwidth` bytes/s."""
    if bytes_per_step <= 0 or bandwidth <= 0:
        raise ValueError("bytes per step and bandwidth must be positive")
    return concurrency * bandwidth / bytes_per_step


def measure_copy_bandwidth(
    device: torch.device, nbytes: int = 1 << 30, repeats: int = 5, warmup: int = 2
) -> float:
    """Bytes/s (read + written) of a device-to-device copy of `nbytes`, median of `repeats`
    copies timed with CUDA events. The buffers are freed (and the cache emptied) afterwards,
    so a KV pool sized later still sees the whole device."""
    if device.type != "cuda":
        raise ValueError(f"copy bandwidth is measured on CUDA devices, not {device}")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    with torch.cuda.device(device):
        for i in range(warmup + repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            if i >= warmup:
                times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def _tensors(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    """Parameters and floating buffers (packed weights may be buffers) of these modules."""
    out: dict[int, torch.Tensor] = {}
    for module in modules:
        for t in module.parameters():
            out[id(t)] = t
        for t in module.buffers():
            if t.is_floating_point() and not _is_rope_cache(module, t):
                out[id(t)] = t
    return list(out.values())


def _is_rope_cache(module: nn.Module, tensor: torch.Tensor) -> bool:
    """Rotary frequency/cos/sin buffers are not weights a traversal streams."""
    for sub in module.modules():
        if "rotary" in type(sub).__name__.lower() and any(
            b is tensor for b in sub.buffers(recurse=False)
        ):
            return True
    return False


def _distinct_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes covered by the tensors' memory, overlaps (views, tied weights) counted once.
    Meta tensors (no memory) count their own size, once per tensor object."""
    tensors = list({id(t): t for t in tensors if t.numel()}.values())
    meta = sum(t.numel() * t.element_size() for t in tensors if t.is_meta)
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for t in tensors
        if not t.is_meta
    )
    total, end = 0, -1
    for lo, hi in spans:
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total + meta
