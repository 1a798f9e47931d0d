"""The `logger` group's schema: which trackers watch a run, and each one's settings (no tracker imported)."""

from __future__ import annotations

from dataclasses import dataclass, field

TRACKERS = ("tensorboard", "mlflow", "wandb")
"""The options of the group, in the order their observers see each record."""
MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
"""Tracker -> the Python module its observer imports (what must be installed)."""
WANDB_MODES = ("online", "offline", "disabled")
"""W&B's modes: online syncs as it goes (needs WANDB_API_KEY), offline writes files for `wandb sync`."""


@dataclass(frozen=True, kw_only=True)
class TensorBoardConfig:
    """TensorBoard event files under RUN_DIR/logs/tensorboard."""

    enabled: bool = False
    """Write scalars (and link profiler traces, with profile=true) for `tensorboard --logdir`."""


@dataclass(frozen=True, kw_only=True)
class MlflowConfig:
    """An MLflow run: the spec as params, spec.yaml as an artifact, metrics per step."""

    enabled: bool = False
    """Log this run to MLflow."""
    tracking_uri: str | None = None
    """null: a file store in RUN_DIR/logs/mlflow; else file:/ABS/PATH or http(s)://HOST[:PORT] of a server."""
    experiment: str = "launcher"
    """The MLflow experiment the run is logged under (created when missing)."""


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """A Weights & Biases run, offline by default (files under RUN_DIR/logs/wandb for `wandb sync`)."""

    enabled: bool = False
    """Log this run to W&B."""
    mode: str = "offline"
    """offline (files only), online (syncs as it runs; your WANDB_API_KEY) or disabled."""
    project: str = "launcher"
    """The W&B project."""
    entity: str | None = None
    """The W&B team or user; null: the default entity of your API key."""


@dataclass(frozen=True, kw_only=True)
class LoggerConfig:
    """Which trackers watch the run, and each one's settings."""

    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    @property
    def selected(self) -> tuple[str, ...]:
        """The enabled trackers, in TRACKERS order."""
        return tuple(name for name in TRACKERS if getattr(self, name).enabled)
