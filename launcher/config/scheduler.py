"""Schema of the scheduler group: learning-rate schedules with linear warmup, stepped once per optimizer step.

What the group builds at run time lives in launcher.components.scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("constant", "linear", "cosine", "inverse_sqrt", "wsd")
DECAY_SHAPES = ("linear", "cosine", "sqrt")
"""WSD's decay shapes: 1 - p, half a cosine, and 1 - sqrt(p) (Hägele et al. 2024) over the decay's progress p."""
FLOORED = ("linear", "cosine", "inverse_sqrt", "wsd")
"""The schedules that decay, so that min_lr_ratio is their floor (constant never decays)."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """How the learning rate moves from warmup to the end of the run."""

    name: str = "cosine"
    """One of constant, linear, cosine, inverse_sqrt, wsd (warmup-stable-decay)."""
    warmup_steps: int = 20
    """Optimizer steps of linear warmup from 0 to the peak learning rate."""
    warmup_ratio: float | None = None
    """Warmup as a fraction of train.max_steps (floored to whole steps); null: warmup_steps decides."""
    min_lr_ratio: float = 0.1
    """Floor of every decaying schedule (linear, cosine, inverse_sqrt, wsd), as a fraction of the peak learning rate."""
    decay_ratio: float = 0.2
    """wsd: the fraction of train.max_steps spent in the final decay (the stable phase holds the peak before it)."""
    decay_shape: str = "sqrt"
    """wsd: the decay's shape, linear, cosine or sqrt (1 - sqrt of the decay's progress)."""


def warmup_of(cfg: SchedulerConfig, max_steps: int) -> int:
    """The warmup in optimizer steps: warmup_ratio x max_steps (floored) where the ratio is set, else warmup_steps."""
    if cfg.warmup_ratio is None:
        return cfg.warmup_steps
    return int(cfg.warmup_ratio * max_steps)


def decay_steps_of(cfg: SchedulerConfig, max_steps: int) -> int:
    """wsd: the steps of the final decay, decay_ratio x max_steps rounded (at least 1)."""
    return max(1, round(cfg.decay_ratio * max_steps))
