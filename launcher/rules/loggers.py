"""Rules of the `logger` group: each selected tracker's library installed, W&B's mode, MLflow's URI."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlparse

from launcher.config.logger import MODULES, WANDB_MODES
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, choice, installed, missing
from launcher.spec import RunSpec, SpecError

PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow-skinny", "wandb": "wandb"}
"""Tracker -> the package its extra installs."""
SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
"""MLflow database backends: they need SQLAlchemy, which mlflow-skinny leaves out."""


def _libraries(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    for name in spec.logger.selected:
        yield from missing(
            MODULES[name],
            (f"logger.{name}.enabled",),
            f"logger={name} needs the {PACKAGES[name]} package, which is not installed here. Install it with "
            f"`pip install 'torch-launcher[{name}]'` (or `pip install {PACKAGES[name]}`), or leave {name} "
            "out of logger=[...].",
        )


def _wandb_mode(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    if spec.logger.wandb.enabled:
        yield from choice("logger.wandb.mode", spec.logger.wandb.mode, WANDB_MODES, "W&B mode")


def _mlflow_uri(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    uri = spec.logger.mlflow.tracking_uri
    if not spec.logger.mlflow.enabled or uri is None:
        return
    problem = uri_problem(uri)
    if problem:
        yield SpecError(
            ("logger.mlflow.tracking_uri",),
            f"{problem} Give file:/ABSOLUTE/PATH (a file store), http(s)://HOST[:PORT] (a tracking server) or "
            "databricks, or leave it null for a file store in RUN_DIR/logs/mlflow.",
        )


def uri_problem(uri: str) -> str | None:
    """What is wrong with an MLflow tracking URI, or None."""
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme == "file":
        if not parsed.path.startswith("/") or parsed.netloc not in ("", "localhost"):
            return f"{uri!r} is not an absolute file: URI (the ranks may run in another directory)."
        return None
    if scheme in ("http", "https"):
        return None if parsed.hostname else f"{uri!r} names no host."
    if scheme == "databricks":
        return None
    if scheme.partition("+")[0] in SQL_SCHEMES:
        if installed("sqlalchemy"):
            return None
        return f"{uri!r} is a database backend, which needs the full mlflow package (`pip install mlflow`)."
    if not scheme:
        return f"{uri!r} has no scheme (file:, http:, https:)."
    return f"{uri!r} has an unknown scheme {scheme!r}."


RULES: tuple[Rule, ...] = (_libraries, _wandb_mode, _mlflow_uri)
"""This module's rules, in the order they report."""
