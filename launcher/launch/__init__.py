"""Where a run goes: the launcher schema and the registry of launch backends."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.launch.slurm import SlurmConfig

if TYPE_CHECKING:
    from launcher.spec import RunSpec

# backend name -> module with `describe(spec, run_dir) -> str` and `launch(spec, run_dir) -> int`
BACKENDS: dict[str, str] = {
    "inline": "launcher.launch.inline",
    "local": "launcher.launch.local",
    "slurm": "launcher.launch.slurm",
}


@dataclass(frozen=True, kw_only=True)
class LauncherConfig:
    """Where and how the ranks of a run are started."""

    backend: str = "auto"
    """auto (inline for one rank, else local), inline (this process), local (nproc processes here) or slurm."""
    nproc: int = 1
    """Processes (ranks) per node."""
    nnodes: int = 1
    """Nodes of the job (world size = nnodes x nproc)."""
    device: str = "auto"
    """auto (a GPU when one is visible, else the CPU), cpu or cuda."""
    max_restarts: int = 0
    """Times a failed job is restarted from its newest checkpoint (needs checkpoints)."""
    master_addr: str = "127.0.0.1"
    """Rendezvous host of a single-node job."""
    master_port: int | None = None
    """Rendezvous port; null picks a free one."""
    timeout_s: float = 300.0
    """Timeout of collectives and of the rendezvous; a rank that does not answer fails the job."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """Resources and preemption settings of the batch job (backend slurm only)."""


def resolve_backend(config: LauncherConfig) -> str:
    """`auto` becomes inline for a one-rank job without restarts, local otherwise; others pass through."""
    if config.backend != "auto":
        return config.backend
    multi = config.nproc * config.nnodes > 1 or config.max_restarts > 0
    return "local" if multi else "inline"


def backend(name: str) -> tuple[Callable[[RunSpec, Path], str], Callable[[RunSpec, Path], int]]:
    """The (describe, launch) pair of a backend, imported on demand."""
    module = importlib.import_module(BACKENDS[name])
    return module.describe, module.launch
