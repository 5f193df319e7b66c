"""Engine configuration: one frozen dataclass per concern, validated at construction.

Torch-free so the scheduler (`rlt_engine.core`) can use it. Every field here is also an
`LLM(...)` keyword and an `rlt generate --field-name` flag of the same name.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # alias, local directory or org/name; None = bundled demo model
    revision: str | None = None
    dtype: str = "auto"  # auto = bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto = cuda when available
    load_format: str = "auto"  # auto | safetensors | dummy

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(
                f"load_format must be auto, safetensors or dummy, got {self.load_format!r}"
            )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None = sized automatically

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # rows of one recurrent traversal
    prefill_chunk_size: int = 512
    refill: bool = True  # False = a decode cohort runs until all its tokens exit

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                "max_num_batched_tokens must be >= max_num_seqs (every running request "
                "needs a row in each traversal)"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """Build from flat keyword options (`LLM(block_size=..)`, `--block-size`)."""
        parts = {}
        for part_name, part_cls in (
            ("model", ModelConfig),
            ("cache", CacheConfig),
            ("scheduler", SchedulerConfig),
        ):
            names = {f.name for f in fields(part_cls)}
            parts[part_name] = part_cls(**{k: options.pop(k) for k in list(options) if k in names})
        if options:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(options))}")
        return cls(**parts)


def engine_option_names() -> list[str]:
    return [f.name for part in (ModelConfig, CacheConfig, SchedulerConfig) for f in fields(part)]
