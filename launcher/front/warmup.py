"""Shorten a default warmup that does not fit a short run, before the rules run and spec.yaml is written.

`train train.max_steps=5` is the first thing many people try; the default 20 warmup steps would
never let the learning rate reach its peak, which the rules refuse. When warmup_steps did not come
from the command line (schema default, an option file or a recipe), it is shortened to a tenth of
the run instead, with a one-line note; a warmup the user typed is still checked and refused.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from launcher.front.config_values import typed, with_values

KEY = "scheduler.warmup_steps"


def _typed(cfg: DictConfig) -> bool:
    """Whether the command line set the warmup (Hydra keeps the overrides under hydra.overrides.task)."""
    overrides = cfg.hydra.overrides.task if "hydra" in cfg else []
    return any(str(o).lstrip("+~").split("=", 1)[0] == KEY for o in overrides)


def fit_warmup(cfg: DictConfig) -> DictConfig:
    """The config with a default warmup shortened to max_steps // 10 when it is not shorter than the run."""
    scheduler, train = typed(cfg, "scheduler"), typed(cfg, "train")
    if scheduler is None or train is None:
        return cfg
    warmup, steps = scheduler.warmup_steps, train.max_steps
    if not 0 < steps <= warmup or _typed(cfg):
        return cfg
    fitted = steps // 10
    print(
        f"note: {KEY}={warmup} (not set on the command line) is not shorter than train.max_steps={steps}; "
        f"this run warms up for {fitted} step(s). Set {KEY} to choose.",
        file=sys.stderr,
    )
    return with_values(cfg, {KEY: fitted})
