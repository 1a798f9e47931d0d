"""Shared helpers: run `train` for real (a subprocess, or in-process for speed) on tiny settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import compose
from launcher.metrics import read_metrics
from launcher.spec import register_schemas

# A run small enough for tests: ~1-2 s of training on 2 CPU cores.
TINY = [
    "model.n_layer=2",
    "model.d_model=64",
    "model.n_head=2",
    "data.seq_len=32",
    "data.max_bytes=400000",
    "train.micro_batch_size=4",
    "train.max_steps=20",
    "train.log_every=1",
    "train.eval_every=10",
    "train.eval_batches=2",
    "scheduler.warmup_steps=2",
    "checkpoint.every=10",
    "log.progress=false",
    "log.summary_table=false",
]


@pytest.fixture(autouse=True, scope="session")
def _schemas() -> None:
    register_schemas()


def run_cli(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    """`train ARGS` in a subprocess, as a user would run it."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_inline(overrides: list[str], run_dir: Path) -> int:
    """Compose, validate, write spec.yaml and run one rank in this process (what `train` does inline)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from launcher import worker
    from launcher.cli import make_run_dir
    from launcher.spec import dump_spec

    cfg = compose.compose([*overrides, f"run_dir={run_dir}"])
    spec, errors = compose.validate(cfg)
    assert not errors, errors
    make_run_dir(run_dir)
    with open_dict(cfg):
        run_cfg = compose.strip_hydra(cfg)
    dump_spec(run_cfg, run_dir / "spec.yaml")
    HydraConfig.instance().cfg = None
    return worker.run(run_dir / "spec.yaml")


def losses(run_dir: Path) -> dict[int, float]:
    """step -> training loss from metrics.jsonl."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}
