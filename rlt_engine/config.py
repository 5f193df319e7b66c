"""Engine configuration: one frozen dataclass per concern, validated at construction.

Torch-free so the scheduler (`rlt_engine.core`) can use it. Every field here is also an
`LLM(...)` keyword and an `rlt generate --field-name` flag of the same name.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum

DTYPES = ("float32", "bfloat16", "float16", "auto")
SCHEDULING_POLICIES = ("fcfs", "priority")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash")


class KVLayout(str, Enum):
    """How KV is kept across loops. LAST_EXITED (exact): one plane per loop, a token's KV on
    plane d comes from its last traversal at loop <= d. SHARED (approximate): one plane, each
    position keeps the KV of its last traversal, 1/D the memory."""

    LAST_EXITED = "last_exited"
    SHARED = "shared"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str | KVLayout) -> KVLayout:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(layout.value for layout in cls)
            raise ValueError(f"kv_layout must be one of {names}, got {value!r}") from None

    def num_planes(self, depth: int) -> int:
        """KV planes this layout keeps for a model of `depth` loops."""
        return depth if self is KVLayout.LAST_EXITED else 1


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # alias, local directory or org/name; None = bundled demo model
    revision: str | None = None
    dtype: str = "auto"  # auto = bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto = cuda when available
    load_format: str = "auto"  # auto | safetensors | dummy
    # the context one request may use, in positions (prompt + max_tokens - 1: the last sampled
    # token is never run); None = the model's max_position_embeddings. A smaller one also
    # shrinks RoPE's table and the KV one request can reserve
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        n = self.max_model_len
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"max_model_len must be a positive integer, got {n!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(
                f"load_format must be auto, safetensors or dummy, got {self.load_format!r}"
            )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_layout: KVLayout = KVLayout.LAST_EXITED
    enable_prefix_caching: bool = False
    # Grow pages as requests advance instead of reserving each one's whole length at
    # admission: a request without max_tokens may run to the end of the context (65,536
    # positions for Ouro), and most end early, so a reservation would hold the pool. With
    # enable_preemption, one that cannot grow is snapshotted to host memory and resumed
    # exactly. Against the reservation at 64/32 (fixed lengths, a roomy pool: its best case):
    # equal on an H100 at c = 1..256, 0.7-0.9% slower at c >= 64 on an H200
    # (benchmarks/results/2026-12-06-growth-default-and-adaptive-h200.md).
    incremental_kv: bool = True
    watermark: float = 0.01  # share of blocks kept free when admitting with incremental_kv
    # Pool size: num_blocks wins, then kv_cache_memory (bytes), then automatic sizing
    # (CUDA: profile a maximal step under gpu_memory_utilization; CPU: a small default).
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        object.__setattr__(self, "kv_layout", KVLayout.parse(self.kv_layout))
        if self.enable_prefix_caching and self.kv_layout is KVLayout.SHARED:
            raise ValueError(
                "prefix caching is implemented for kv_layout=last_exited only; "
                "drop --enable-prefix-caching or use the last_exited layout"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must lie in [0, 1), got {self.watermark}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(
                f"kv_cache_memory must be a positive byte count, got {self.kv_cache_memory}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # rows of one recurrent traversal
    prefill_chunk_size: int = 512
    refill: bool = True  # False = a decode cohort runs until all its tokens exit
    scheduling_policy: str = "fcfs"  # fcfs | priority (lower `priority` value first)
    enable_preemption: bool = True  # snapshot to CPU on memory pressure or priority
    max_bypass: int = 32  # priority: a waiting request is overtaken at most this often

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.max_bypass < 1:
            raise ValueError(f"max_bypass must be >= 1, got {self.max_bypass}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                "max_num_batched_tokens must be >= max_num_seqs (every running request "
                "needs a row in each traversal)"
            )


@dataclass(frozen=True)
class ExecutionConfig:
    """How the worker runs the model; never changes what it computes."""

    attention_backend: str = "auto"  # auto = triton on CUDA, torch on CPU
    enforce_eager: bool = False  # True = no CUDA graphs (to compare, or to debug)
    decode_window: int = 8  # decode traversals per step, with one read back per window
    # plan window n+1 while window n runs (results one window late); None = on for CUDA
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.decode_window < 1:
            raise ValueError(f"decode_window must be >= 1, got {self.decode_window}")


_PARTS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "execution": ExecutionConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    execution: ExecutionConfig = ExecutionConfig()

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """Build from flat keyword options (`LLM(block_size=..)`, `--block-size`)."""
        parts = {}
        for part_name, part_cls in _PARTS.items():
            names = {f.name for f in fields(part_cls)}
            parts[part_name] = part_cls(**{k: options.pop(k) for k in list(options) if k in names})
        if options:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(options))}")
        return cls(**parts)


def engine_option_names() -> list[str]:
    return [f.name for part in _PARTS.values() for f in fields(part)]
