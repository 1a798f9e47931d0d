"""The scheduler group: learning-rate schedules with linear warmup, stepped once per optimizer step.

Every decaying schedule ends at (linear, cosine, wsd) or never falls below (inverse_sqrt) the floor
min_lr_ratio. wsd holds the peak after warmup and decays over the last decay_ratio of the run, as
torchtitan's warmup-stable-decay does: its last step (step max_steps - 1) runs at the floor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from launcher.config.scheduler import SchedulerConfig, decay_steps_of, warmup_of

if TYPE_CHECKING:  # torch only where a rank trains: the launching process never needs it
    import torch

DECAY: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "sqrt": lambda p: 1.0 - math.sqrt(p),
}
"""wsd's decay shapes: progress p in [0, 1] -> the share of the way from the floor to the peak."""


def _wsd(cfg: SchedulerConfig, max_steps: int) -> Callable[[int], float]:
    """The factor after warmup: 1 until the decay's start, then down to min_lr_ratio at the last step."""
    decay, floor, shape = decay_steps_of(cfg, max_steps), cfg.min_lr_ratio, DECAY[cfg.decay_shape]
    start = max_steps - decay

    def factor(step: int) -> float:
        if step < start:
            return 1.0
        progress = min(1.0, (step + 1 - start) / decay)
        return floor + (1.0 - floor) * shape(progress)

    return factor


def lr_factor(cfg: SchedulerConfig, max_steps: int) -> Callable[[int], float]:
    """The multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    warmup, floor = warmup_of(cfg, max_steps), cfg.min_lr_ratio
    wsd = _wsd(cfg, max_steps) if cfg.name == "wsd" else None

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.name == "constant":
            return 1.0
        if wsd is not None:
            return wsd(step)
        if cfg.name == "inverse_sqrt":
            return max(floor, math.sqrt(max(warmup, 1) / (step + 1)))
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        if cfg.name == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `optimizer` following the configured schedule."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, max_steps))
