"""The scheduler group: learning-rate schedules with linear warmup, stepped once per optimizer step."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from launcher.config.scheduler import SchedulerConfig

if TYPE_CHECKING:  # torch only where a rank trains: the launching process never needs it
    import torch


def lr_factor(cfg: SchedulerConfig, max_steps: int) -> Callable[[int], float]:
    """The multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.name == "constant":
            return 1.0
        if cfg.name == "inverse_sqrt":
            return math.sqrt(max(warmup, 1) / (step + 1))
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
