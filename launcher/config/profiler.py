"""Schema of profiling: torch.profiler traces of a few training steps into RUN_DIR/profile/, and the top operators.

What the group builds at run time lives in launcher.components.profiling.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ProfilerConfig:
    """Settings of torch.profiler when `profile=true`."""

    wait: int = 1
    """Optimizer steps skipped at the start of each cycle."""
    warmup: int = 1
    """Steps traced but discarded (the profiler's own start-up cost)."""
    active: int = 3
    """Steps recorded into a trace per cycle."""
    repeat: int = 1
    """Cycles of wait + warmup + active; 0 repeats until the run ends."""
    profile_memory: bool = True
    """Record tensor allocations and frees (memory per operator, memory timeline in the trace)."""
    record_shapes: bool = True
    """Record the input shapes of operators."""
    with_stack: bool = False
    """Record Python stacks of operators (larger traces)."""
    top_ops: int = 15
    """Operators listed in the printed table."""

    def steps_needed(self) -> int:
        """Optimizer steps one complete cycle takes."""
        return self.wait + self.warmup + self.active
