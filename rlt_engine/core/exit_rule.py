"""When a token leaves the loop: Ouro's exit-gate rule, in exact fp32 arithmetic, without torch.

After loop t (1-based count `loops_done`) with hazard λ_t, the remaining mass is
R_t = Π (1 - λ_i) and CDF_t = 1 - R_t. Exit when loops_done >= max_loops, or when the
threshold is below 1, loops_done >= min_loops and CDF_t >= threshold. Every operation is
rounded to fp32 exactly as a float32 tensor computation would round it (the published HF code
does this in bf16 and can exit early even at threshold 1.0; we do not reproduce that defect).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass


def f32(x: float) -> float:
    """Round a Python float to the nearest float32 value."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class LoopControls:
    min_loops: int
    max_loops: int
    exit_threshold: float

    def validate(self, depth: int) -> None:
        if not 1 <= self.min_loops <= self.max_loops <= depth:
            raise ValueError(
                f"need 1 <= min_loops ({self.min_loops}) <= max_loops ({self.max_loops}) "
                f"<= model depth ({depth})"
            )
        if not 0.0 <= self.exit_threshold <= 1.0:
            raise ValueError(f"exit_threshold must lie in [0, 1], got {self.exit_threshold}")

    def may_exit_early(self, depth: int) -> bool:
        """Can a token leave before the model's depth (so its K/V needs exit copies)?"""
        return self.max_loops < depth or self.exit_threshold < 1.0


@dataclass
class ExitTracker:
    """Per-token progress through the loops: the remaining mass R, kept in fp32."""

    controls: LoopControls
    remaining: float = 1.0
    loops_done: int = 0

    def step(self, hazard: float | None) -> bool:
        """Record one finished loop (its hazard, None for gateless models); True = exit now."""
        self.loops_done += 1
        if hazard is not None:
            self.remaining = f32(self.remaining * f32(1.0 - f32(hazard)))
        if self.loops_done >= self.controls.max_loops:
            return True
        if hazard is None or self.controls.exit_threshold >= 1.0:
            return False
        cdf = f32(1.0 - self.remaining)
        return self.loops_done >= self.controls.min_loops and cdf >= f32(
            self.controls.exit_threshold
        )
