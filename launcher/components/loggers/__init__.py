"""The `logger` group: experiment trackers that mirror metrics.jsonl on rank 0 (TensorBoard, MLflow, W&B).

Several at once: `logger=[tensorboard,mlflow]` (Hydra's list of options); `logger=tensorboard` for
one. Each option file sets its tracker's `enabled`; metrics.jsonl is written whatever is selected.
This module imports no tracker library: each is imported by its observer's constructor on rank 0,
so `train --help` and a dry run stay fast, and a tracker that is not installed is refused before
launch (launcher.rules.loggers) with the extra to install.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from launcher.config.logger import (
    MODULES,
    TRACKERS,
    WANDB_MODES,
    LoggerConfig,
    MlflowConfig,
    TensorBoardConfig,
    WandbConfig,
)

if TYPE_CHECKING:
    from launcher.components.loggers.observers import Observer, RunContext

__all__ = [
    "MODULES",
    "TRACKERS",
    "WANDB_MODES",
    "LoggerConfig",
    "MlflowConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "build",
]


def build(config: LoggerConfig, context: RunContext) -> list[Observer]:
    """The observers of the selected trackers (rank 0 only); each imports its library here.

    A tracker that does not start (a server out of reach, say) is reported and left out: watching a
    run never stops it.
    """
    from launcher.components.loggers import to_mlflow, to_tensorboard, to_wandb

    makers = {
        "tensorboard": lambda: to_tensorboard.TensorBoardLogger(config.tensorboard, context),
        "mlflow": lambda: to_mlflow.MlflowLogger(config.mlflow, context),
        "wandb": lambda: to_wandb.WandbLogger(config.wandb, context),
    }
    observers: list[Observer] = []
    for name in config.selected:
        try:
            observers.append(makers[name]())
        except Exception as err:  # noqa: BLE001 - a tracker never stops the run
            warnings.warn(
                f"logger={name} did not start and is left out of this session: {err!r}", stacklevel=2
            )
    return observers
