"""Building blocks shared by the looped models (Hugging Face parameter names)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlt_engine.kernels.split_sums import SplitSums
from rlt_engine.models.attention import AttentionBackend, AttentionMetadata
from rlt_engine.models.configs import LoopedLMConfig


class RMSNorm(nn.Module):
    fused = False  # one Triton kernel (kernels/norm.py) instead of eight; set by use_fast_path

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`weight * norm(x)`, plus `residual` when given (the sandwich norm's add)."""
        if self.fused:
            from rlt_engine.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual=residual)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return out if residual is None else residual + out


def add_norm(
    y: torch.Tensor | SplitSums,
    residual: torch.Tensor,
    norm: RMSNorm,
    y_norm: RMSNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, norm(x)) with x = residual + y_norm(y), or residual + y without y_norm: the residual
    add and the next norm in one launch (kernels/norm_chain; fast path only), bit-identical to
    `y_norm(y, residual=residual)` (or `residual + y`) followed by `norm(x)` with fused norms.
    y may be a split-K GEMM's unsummed partials (`project(..., unreduced=True)`)."""
    from rlt_engine.kernels.norm_chain import add_rms_norm

    if y_norm is None:
        return add_rms_norm(y, residual, norm.weight, norm.eps)
    return add_rms_norm(y, residual, norm.weight, norm.eps, y_norm.weight, y_norm.eps)


def add_norm_hazard(
    y: torch.Tensor | SplitSums,
    residual: torch.Tensor,
    norm: RMSNorm,
    y_norm: RMSNorm | None,
    exit_gate: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_norm`, and the exit hazard sigmoid(norm(x) . w + b) of the fp32 gate (w, b) from
    the same launch (kernels/norm_chain.add_rms_norm_hazard: to a few ulps of torch's)."""
    from rlt_engine.kernels.norm_chain import add_rms_norm_hazard

    y_weight, y_eps = (None, None) if y_norm is None else (y_norm.weight, y_norm.eps)
    return add_rms_norm_hazard(y, residual, norm.weight, norm.eps, *exit_gate, y_weight, y_eps)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


class RotaryEmbedding(nn.Module):
    """Half-rotation RoPE. Angles are always computed in fp32."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta), persistent=False)
        # dtype -> [positions, 2, head_dim]: cos and sin of every position below its length
        self.tables: dict[torch.dtype, torch.Tensor] = {}

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        # `.to(torch.bfloat16)` would round inv_freq and shift every angle: recompute in fp32
        # (on the CPU, as the reference implementations do, then move it).
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta).to(self.inv_freq.device)
        self.tables = {}
        return self

    def precompute(self, num_positions: int, dtype: torch.dtype) -> None:
        """Keep cos / sin of positions [0, num_positions) in `dtype`: `forward` then gathers
        rows (one launch) instead of computing them (seven). The same elementwise arithmetic
        on the same inputs, so the same values. The caller keeps positions below the bound."""
        positions = torch.arange(num_positions, device=self.inv_freq.device)
        self.tables[dtype] = torch.stack(self.angles(positions, dtype), dim=1)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        table = self.tables.get(dtype)
        if table is None:
            return self.angles(positions, dtype)
        return table.index_select(0, positions).unbind(1)  # rows with a stride of 2 * head_dim

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [rows, heads, head_dim]; cos/sin: [rows, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def project(
    x: torch.Tensor,
    weight: torch.Tensor,
    small_gemm: bool,
    prefetch_whole: bool = False,
    unreduced: bool = False,
) -> torch.Tensor | SplitSums:
    """`F.linear(x, weight)`; with `small_gemm` (the fast path) through kernels/small_gemm,
    which picks its Triton split-K kernel for decode-sized x where it beats cuBLAS
    (`prefetch_whole`, `unreduced`: see small_gemm.linear; an unreduced output goes only to
    `add_norm`)."""
    if small_gemm:
        from rlt_engine.kernels.small_gemm import linear

        return linear(x, weight, prefetch_whole=prefetch_whole, unreduced=unreduced)
    return F.linear(x, weight)


def pack_linears(*linears: nn.Linear) -> torch.Tensor:
    """One weight for several projections of the same input (one GEMM instead of several).
    The modules keep their parameters as views into it, so names and memory stay as loaded."""
    packed = torch.cat([lin.weight.detach() for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(packed[start : start + rows], requires_grad=False)
        start += rows
    return packed


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up: torch.Tensor | None = None  # packed [2 * intermediate, hidden]
        self.small_gemm = False  # kernels/small_gemm for gate_up and down; set by use_fast_path
        self.fused_act = False  # kernels/swiglu: silu(gate) * up in one launch; use_fast_path

    def pack(self) -> None:
        self.gate_up = pack_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, unreduced: bool = False) -> torch.Tensor | SplitSums:
        """`unreduced`: the down projection may return split-K partials (see `project`)."""
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.fused_act and self.small_gemm:  # the GEMM and the activation in one launch
            from rlt_engine.kernels.gate_up_swiglu import gate_up_silu

            act = gate_up_silu(x, self.gate_up)
            if act is not None:
                return project(act, self.down_proj.weight, True, unreduced=unreduced)
        gate_up = project(x, self.gate_up, self.small_gemm)
        if self.fused_act:
            from rlt_engine.kernels.swiglu import silu_mul

            act = silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return project(act, self.down_proj.weight, self.small_gemm, unreduced=unreduced)


class Attention(nn.Module):
    def __init__(self, cfg: LoopedLMConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.qkv: torch.Tensor | None = None  # packed [(heads + 2 kv_heads) * head_dim, hidden]
        self.fused_rope = False
        self.small_gemm = False  # kernels/small_gemm for qkv and o_proj; set by use_fast_path

    def pack(self) -> None:
        self.qkv = pack_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        unreduced: bool = False,
    ) -> torch.Tensor | SplitSums:
        """`unreduced`: the o_proj may return split-K partials (see `project`)."""
        rows, d = x.shape[0], self.head_dim
        project_attend = getattr(backend, "project_attend", None)
        if self.qkv is not None and self.small_gemm and self.fused_rope and project_attend:
            # decode rows: RoPE and the K/V write in the qkv GEMM's epilogue where it can
            out = project_attend(self.layer, x, self.qkv, rope, meta)
            if out is not None:
                return self._o_proj(out.reshape(rows, self.num_heads * d), unreduced)
        if self.qkv is None:
            q = self.q_proj(x).view(rows, self.num_heads, d)
            k = self.k_proj(x).view(rows, self.num_kv_heads, d)
            v = self.v_proj(x).view(rows, self.num_kv_heads, d)
        else:
            qkv = project(x, self.qkv, self.small_gemm)
            qkv = qkv.view(rows, self.num_heads + 2 * self.num_kv_heads, d)
            q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        attend_rope = getattr(backend, "attend_rope", None) if self.fused_rope else None
        if attend_rope is not None:  # RoPE and the K/V write in one launch (Triton backend)
            out = attend_rope(self.layer, q, k, v, rope, meta)
        else:
            if self.fused_rope:
                from rlt_engine.kernels.rope import apply_rope_

                apply_rope_(q, k, *rope)
            else:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            out = backend.attend(self.layer, q, k, v, meta)
        return self._o_proj(out.reshape(rows, self.num_heads * d), unreduced)

    def _o_proj(self, out: torch.Tensor, unreduced: bool) -> torch.Tensor | SplitSums:
        if self.small_gemm:  # attention reads little of HBM: the o_proj's weight streams meanwhile
            return project(out, self.o_proj.weight, True, prefetch_whole=True, unreduced=unreduced)
        return self.o_proj(out)
