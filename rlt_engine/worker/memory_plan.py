"""How big the paged KV pool is, and why: a `MemoryPlan` resolved once at engine start.

A block holds `block_size` token slots of K and V for every layer of ONE plane, so
bytes per block = 2 x layers x block_size x kv_heads x head_dim x dtype bytes. LAST_EXITED
keeps one plane per loop depth (a token occupies a slot on each of the D planes); SHARED keeps
a single plane. The pool is sized, in order of precedence, from an explicit block count, an
explicit KV byte budget, a CUDA profile of the largest step, or (any other device) a default
sized from the model: room for one sequence at the model's full context, or as many token
positions as the weights' own bytes buy if that is more, never more than `max_num_seqs` full
contexts nor CPU_DEFAULT_KV_BYTES.

Torch is imported only inside `profile_kv_budget`, so the planning arithmetic stays usable
(and testable) without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlt_engine.config import KVLayout
from rlt_engine.models.configs import LoopedLMConfig

if TYPE_CHECKING:
    import torch

MiB = 1 << 20
GiB = 1 << 30
CPU_DEFAULT_KV_BYTES = 512 * MiB  # the most the CPU default ever takes
DEFAULT_CUDA_RESERVE_BYTES = 256 * MiB  # sampler buffers, CUDA graphs, allocator slack
PLAN_SOURCES = ("num_blocks", "kv_cache_memory", "profiled", "cpu_default")


def format_bytes(n: int | float) -> str:
    """1.50 GiB, 3.00 MiB, 192.00 KiB, 12 B."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def num_planes(cfg: LoopedLMConfig, kv_layout: KVLayout | str) -> int:
    """KV planes a layout keeps: the model depth for LAST_EXITED, one for SHARED."""
    return KVLayout.parse(kv_layout).num_planes(cfg.num_loops)


def bytes_per_block(cfg: LoopedLMConfig, block_size: int, dtype_bytes: int) -> int:
    """K and V of every layer for `block_size` tokens on one plane."""
    _positive_int("block_size", block_size)
    _positive_int("dtype_bytes", dtype_bytes)
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """The resolved KV pool. Build it with `plan_from_num_blocks` or `plan_from_budget`."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    num_planes: int
    kv_layout: KVLayout
    kv_bytes_total: int
    max_concurrent_tokens: int  # token positions whose KV fits on every plane at once
    source: str  # num_blocks | kv_cache_memory | profiled | cpu_default

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "bytes_per_block", "num_planes"):
            _positive_int(name, getattr(self, name))
        object.__setattr__(self, "kv_layout", KVLayout.parse(self.kv_layout))
        if self.source not in PLAN_SOURCES:
            raise ValueError(f"source must be one of {', '.join(PLAN_SOURCES)}")
        if self.kv_bytes_total != self.num_blocks * self.bytes_per_block:
            raise ValueError("kv_bytes_total must equal num_blocks * bytes_per_block")
        if self.max_concurrent_tokens != _token_capacity(
            self.num_blocks, self.block_size, self.num_planes
        ):
            raise ValueError("max_concurrent_tokens must be (num_blocks // planes) * block_size")

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token position occupies across all planes."""
        return self.bytes_per_block * self.num_planes // self.block_size

    def describe(self) -> dict[str, Any]:
        """Plain values for `rlt generate --verbose` and logs."""
        return {
            "kv_layout": self.kv_layout.value,
            "num_planes": self.num_planes,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "bytes_per_block": self.bytes_per_block,
            "block": format_bytes(self.bytes_per_block),
            "kv_bytes_total": self.kv_bytes_total,
            "kv_cache": format_bytes(self.kv_bytes_total),
            "bytes_per_token": self.bytes_per_token,
            "per_token": format_bytes(self.bytes_per_token),
            "max_concurrent_tokens": self.max_concurrent_tokens,
            "source": self.source,
        }


def _token_capacity(num_blocks: int, block_size: int, planes: int) -> int:
    """A token needs one slot on each plane; tables of all planes grow in whole blocks."""
    return (num_blocks // planes) * block_size


def plan_from_num_blocks(
    cfg: LoopedLMConfig,
    *,
    num_blocks: int,
    block_size: int,
    dtype_bytes: int,
    kv_layout: KVLayout | str,
    source: str = "num_blocks",
) -> MemoryPlan:
    """A pool of exactly `num_blocks` blocks (enough for one block on every plane)."""
    _positive_int("num_blocks", num_blocks)
    planes = num_planes(cfg, kv_layout)
    if num_blocks < planes:
        raise ValueError(
            f"num_blocks={num_blocks} cannot hold even one token: kv_layout={str(kv_layout)!r} "
            f"needs a block on each of its {planes} planes"
        )
    per_block = bytes_per_block(cfg, block_size, dtype_bytes)
    return MemoryPlan(
        num_blocks=num_blocks,
        block_size=block_size,
        bytes_per_block=per_block,
        num_planes=planes,
        kv_layout=kv_layout,
        kv_bytes_total=num_blocks * per_block,
        max_concurrent_tokens=_token_capacity(num_blocks, block_size, planes),
        source=source,
    )


def plan_from_budget(
    cfg: LoopedLMConfig,
    *,
    block_size: int,
    dtype_bytes: int,
    kv_layout: KVLayout | str,
    budget_bytes: int,
    source: str,
) -> MemoryPlan:
    """The most blocks that fit in `budget_bytes`, rounded down to whole groups of planes."""
    planes = num_planes(cfg, kv_layout)
    per_block = bytes_per_block(cfg, block_size, dtype_bytes)
    groups = budget_bytes // (per_block * planes) if budget_bytes > 0 else 0
    if groups < 1:
        raise ValueError(
            f"a KV budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes) is too small: "
            f"kv_layout={str(kv_layout)!r} needs {planes} block(s) of {format_bytes(per_block)} "
            f"({per_block} bytes, block_size={block_size}) for even one block of tokens"
        )
    return plan_from_num_blocks(
        cfg,
        num_blocks=groups * planes,
        block_size=block_size,
        dtype_bytes=dtype_bytes,
        kv_layout=kv_layout,
        source=source,
    )


def resolve_memory_plan(
    cfg: LoopedLMConfig,
    *,
    device_type: str,
    block_size: int,
    dtype_bytes: int,
    kv_layout: KVLayout | str,
    num_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    profile: Callable[[], int] | None = None,
    weight_bytes: int = 0,
    max_num_seqs: int | None = None,
) -> MemoryPlan:
    """Explicit num_blocks, else explicit kv_cache_memory bytes, else (CUDA) the profiled
    budget from `profile()`, else (any other device) `cpu_default_budget` of the model."""
    if num_blocks is not None and kv_cache_memory is not None:
        raise ValueError("give at most one of num_blocks and kv_cache_memory")
    common: dict[str, Any] = dict(
        block_size=block_size, dtype_bytes=dtype_bytes, kv_layout=kv_layout
    )
    if num_blocks is not None:
        return plan_from_num_blocks(cfg, num_blocks=num_blocks, **common)
    if kv_cache_memory is not None:
        _positive_int("kv_cache_memory", kv_cache_memory)
        return plan_from_budget(
            cfg, budget_bytes=kv_cache_memory, source="kv_cache_memory", **common
        )
    if device_type == "cuda":
        if profile is None:
            raise ValueError("sizing the KV cache on CUDA needs a profile function")
        return plan_from_budget(cfg, budget_bytes=profile(), source="profiled", **common)
    budget = cpu_default_budget(
        cfg,
        block_size=block_size,
        dtype_bytes=dtype_bytes,
        kv_layout=kv_layout,
        weight_bytes=weight_bytes,
        max_num_seqs=max_num_seqs,
    )
    return plan_from_budget(cfg, budget_bytes=budget, source="cpu_default", **common)


def cpu_default_budget(
    cfg: LoopedLMConfig,
    *,
    block_size: int,
    dtype_bytes: int,
    kv_layout: KVLayout | str,
    weight_bytes: int = 0,
    max_num_seqs: int | None = None,
) -> int:
    """KV bytes of the CPU default pool, sized from the model instead of a fixed 512 MiB (a 9 MB
    model does not need half a gigabyte of zeros): the larger of one full-context sequence (so
    any single request fits) and `weight_bytes` (the KV pool as big as the model), at most
    `max_num_seqs` full-context sequences and CPU_DEFAULT_KV_BYTES, at least one block per plane.
    """
    planes = num_planes(cfg, kv_layout)
    group = bytes_per_block(cfg, block_size, dtype_bytes) * planes  # one block on every plane
    context_groups = -(-cfg.max_position_embeddings // block_size)
    wanted = max(context_groups * group, max(0, weight_bytes))
    if max_num_seqs is not None:
        wanted = min(wanted, _positive_int("max_num_seqs", max_num_seqs) * context_groups * group)
    return max(group, min(wanted, CPU_DEFAULT_KV_BYTES))


def check_utilization(gpu_memory_utilization: float) -> float:
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {gpu_memory_utilization}")
    return gpu_memory_utilization


def kv_budget_from_profile(
    *,
    total_bytes: int,
    peak_allocated_bytes: int,
    non_torch_bytes: int,
    gpu_memory_utilization: float,
    reserve_bytes: int,
    stranded_bytes: int = 0,
) -> int:
    """allowed - (peak PyTorch allocation of the largest step + memory outside PyTorch +
    memory PyTorch holds but cannot hand out whole + reserve), where allowed = total *
    gpu_memory_utilization. Raises when nothing is left.

    `stranded_bytes`: cached memory that empty_cache could not return (free pieces of segments
    that some live tensor still pins, CUDA-graph pools of a previous engine in the process). The
    KV pool is two large tensors that need fresh segments, so those pieces are not room for it:
    counting them as free once made a second engine in one process ask for 62 GiB that existed
    only as a 61.77 GiB fragment."""
    check_utilization(gpu_memory_utilization)
    if reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
    allowed = int(total_bytes * gpu_memory_utilization)
    outside = max(0, non_torch_bytes) + max(0, stranded_bytes)
    used = peak_allocated_bytes + outside + reserve_bytes
    budget = allowed - used
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: the model and activations use "
            f"{used / GiB:.2f} GiB (peak PyTorch {peak_allocated_bytes / GiB:.2f} GiB, outside "
            f"PyTorch or stranded in its cache {outside / GiB:.2f} GiB, reserve "
            f"{reserve_bytes / GiB:.2f} GiB) of the {allowed / GiB:.2f} GiB allowed by "
            f"gpu_memory_utilization="
            f"{gpu_memory_utilization}; raise it or lower max_num_batched_tokens"
        )
    return budget


def profile_kv_budget(
    device: torch.device | str,
    *,
    gpu_memory_utilization: float,
    run_max_step: Callable[[], None],
    reserve_bytes: int,
) -> int:
    """KV bytes left on a CUDA device after the largest step, `run_max_step()`, has run.

    Call it with the weights loaded and before the KV pool exists. Memory used outside
    PyTorch's allocator (CUDA context, other processes) and memory stranded in its cache are
    deducted too.
    """
    import torch

    check_utilization(gpu_memory_utilization)
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"profile_kv_budget needs a CUDA device, got {dev}")
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    run_max_step()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    torch.cuda.empty_cache()  # give back the step's activations: what stays cached is stranded
    free, total = torch.cuda.mem_get_info(dev)
    reserved = torch.cuda.memory_reserved(dev)
    return kv_budget_from_profile(
        total_bytes=total,
        peak_allocated_bytes=peak,
        non_torch_bytes=total - free - reserved,
        gpu_memory_utilization=gpu_memory_utilization,
        reserve_bytes=reserve_bytes,
        stranded_bytes=reserved - torch.cuda.memory_allocated(dev),
    )
