"""Shorten a default warmup that does not fit a short run, before the rules run and spec.yaml is written.

`train train.max_steps=5` is the first thing many people try; the default 20 warmup steps would
never let the learning rate reach its peak, which the rules refuse. When warmup_steps did not come
from the command line, it is shortened to a tenth of the run instead. A default (the schema's, or a
shipped scheduler option's) is the launcher's own business and is shortened without a word; a
warmup a person wrote into a file (a recipe or experiment, an option of their own config directory)
is shortened with a one-line note naming that file; a warmup the user typed is checked and refused.

`scheduler.warmup_ratio` writes its warmup (ratio x max_steps, floored) into warmup_steps, so spec.yaml
holds the steps the run warms up for; a warmup_steps someone set on purpose as well is refused.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig, OmegaConf

from launcher.front import provenance
from launcher.front.config_values import typed, with_values
from launcher.spec import SpecError

KEY = "scheduler.warmup_steps"
RATIO_KEY = "scheduler.warmup_ratio"


def _typed(cfg: DictConfig, key: str = KEY) -> bool:
    """Whether the command line set `key` (Hydra keeps the overrides under hydra.overrides.task)."""
    overrides = OmegaConf.to_container(cfg.hydra.overrides.task, resolve=False) if "hydra" in cfg else []
    return any(str(o).lstrip("+~").split("=", 1)[0] == key for o in overrides)


def fill_warmup_ratio(cfg: DictConfig) -> tuple[DictConfig, list[SpecError]]:
    """The config with warmup_steps = warmup_ratio x max_steps where the ratio is set; an error where warmup_steps
    was set on purpose too (typed, or in a recipe or a file of one's own)."""
    from launcher.config.scheduler import warmup_of

    scheduler, train = typed(cfg, "scheduler"), typed(cfg, "train")
    if scheduler is None or train is None or scheduler.warmup_ratio is None:
        return cfg, []
    if not 0 <= scheduler.warmup_ratio < 1:  # launcher.rules.keys names the range
        return cfg, []
    source = "the command line" if _typed(cfg) else set_in_file(cfg)
    if source is not None:
        return cfg, [
            SpecError(
                (KEY, RATIO_KEY),
                f"{KEY}={scheduler.warmup_steps} (set by {source}) and {RATIO_KEY}={scheduler.warmup_ratio} "
                f"both set the warmup. Keep one: drop {RATIO_KEY}, or drop {KEY} (from {source}).",
            )
        ]
    return with_values(cfg, {KEY: warmup_of(scheduler, train.max_steps)}), []


def set_in_file(cfg: DictConfig) -> str | None:
    """The config file a person set the warmup in (`recipe=NAME`, `scheduler=OPTION` of their own config
    directory, ...), or None where it is the launcher's default."""
    source = provenance.explicit(cfg).get(KEY)
    if source is None:
        return None
    group, _, option = source.partition("=")
    own = any((folder / group / f"{option}.yaml").is_file() for folder in provenance.user_dirs(cfg))
    return None if group == "scheduler" and not own else source  # a shipped schedule's own default


def fit_warmup(cfg: DictConfig) -> DictConfig:
    """The config with a default warmup shortened to max_steps // 10 when it is not shorter than the run."""
    scheduler, train = typed(cfg, "scheduler"), typed(cfg, "train")
    if scheduler is None or train is None:
        return cfg
    warmup, steps = scheduler.warmup_steps, train.max_steps
    if not 0 < steps <= warmup or _typed(cfg):
        return cfg
    fitted = steps // 10
    source = set_in_file(cfg)
    if source is not None:
        print(
            f"note: {KEY}={warmup} (set by {source}) is not shorter than train.max_steps={steps}; "
            f"this run warms up for {fitted} step(s). Set {KEY} on the command line to choose.",
            file=sys.stderr,
        )
    return with_values(cfg, {KEY: fitted})
