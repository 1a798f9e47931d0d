"""Schema of the scheduler group: learning-rate schedules with linear warmup, stepped once per optimizer step.

What the group builds at run time lives in launcher.components.scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("constant", "linear", "cosine", "inverse_sqrt")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """How the learning rate moves from warmup to the end of the run."""

    name: str = "cosine"
    """One of constant, linear, cosine, inverse_sqrt."""
    warmup_steps: int = 20
    """Optimizer steps of linear warmup from 0 to the peak learning rate."""
    min_lr_ratio: float = 0.1
    """Floor of linear and cosine decay, as a fraction of the peak learning rate."""
