"""What a loaded engine is and runs, in plain values: one object for every front door.

`rlt generate --verbose`, the `rlt bench` / `rlt profile` report headers and the server's
`/v1/models` and `/metrics` read this instead of reaching into the engine's parts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class EngineInfo:
    model: str  # the name asked for: alias, directory or org/name
    model_dir: str  # where it was loaded from
    model_type: str  # ouro | nanbeige
    num_loops: int  # the model's depth
    max_model_len: int  # positions of context (prompt + output)
    vocab_size: int
    has_tokenizer: bool
    device: str
    device_name: str  # the GPU's name, or "cpu"
    dtype: str
    # the KV pool as resolved (worker.memory_plan.MemoryPlan.describe())
    kv_layout: str
    num_planes: int
    num_blocks: int
    block_size: int
    kv_cache: dict[str, Any]
    max_num_seqs: int
    attention_backend: str  # as asked: auto | torch | triton | flash
    attention_impl: str  # what runs: torch | triton
    cuda_graphs: bool
    decode_window: int
    # the decode fast path's kernel switches as resolved (benchmarks/README.md, "A/B
    # switches"): pdl, small_gemm (table | cublas | triton), fused_rows (kernels/slot_step)
    kernels: dict[str, Any]
    # loop controls a request gets when it sets none (min loops, max loops, exit threshold)
    default_min_loops: int
    default_max_loops: int
    default_exit_threshold: float
    notice: str | None  # a one-line note for the user (e.g. "using the bundled demo model")
    # CUDA graphs captured at start-up and the host seconds they took (the rest are captured
    # on first use: EngineStats counts all)
    graphs_at_start: int = 0
    graph_capture_s_at_start: float = 0.0

    @property
    def max_request_positions(self) -> int:
        """Positions one request can ever hold: the model's context, or less where the KV
        pool holds less (every plane of every position, as admission counts it)."""
        return min(self.max_model_len, self.num_blocks // self.num_planes * self.block_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
