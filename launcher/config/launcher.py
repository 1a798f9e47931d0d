"""The launcher group's schema: where the ranks of a run start (backend, ranks, nodes, SLURM resources).

The backends themselves are launcher/launch/ (one module each).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

BACKENDS = ("auto", "inline", "local", "slurm", "torchrun")
"""Options of launcher.backend (auto is decided before the rules run: see resolve_backend; torchrun is
recorded by `train` itself when an outer torchrun started it)."""


@dataclass(frozen=True, kw_only=True)
class SlurmConfig:
    """Resources and behaviour of the batch job (nodes = launcher.nnodes, tasks per node = launcher.nproc)."""

    partition: str | None = None
    """Partition to submit to; null: the cluster's default partition."""
    account: str | None = None
    """Account charged for the job; null: your default account."""
    qos: str | None = None
    """Quality of service; null: the default."""
    constraint: str | None = None
    """Node features the job needs (sbatch --constraint), e.g. a100."""
    time_min: str | None = "60"
    """Time limit as sbatch --time takes it: minutes (90), MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS; null: the partition's."""
    gpus_per_node: int = 0
    """GPUs per node (sbatch --gpus-per-node); with GPUs, launcher.nproc must equal it (one rank per GPU)."""
    cpus_per_task: int | None = None
    """CPU cores per rank; null: SLURM's default (1)."""
    mem_gb: float | None = None
    """Memory per node in GB; null: the partition's default."""
    extra_sbatch: list[str] = field(default_factory=list)
    """More sbatch options, one per entry, e.g. ["--mail-type=END", "--exclusive"]."""
    signal: str = "USR2"
    """Signal SLURM sends the ranks before the time limit; the run checkpoints and requeues on it."""
    signal_lead_s: int = 120
    """Seconds before the time limit that signal comes (must exceed a step plus a checkpoint)."""
    max_requeues: int = 3
    """Times a preempted job requeues itself (SLURM_RESTART_COUNT counts them); 0 never."""
    port: int | None = None
    """Rendezvous port on the first node; null: derived from the job id (jobs sharing a node differ)."""
    wait: bool = True
    """Wait for the job to end and return its exit status; a --multirun sweep never waits per point."""


@dataclass(frozen=True, kw_only=True)
class LauncherConfig:
    """Where and how the ranks of a run are started."""

    backend: str = "auto"
    """auto (inline for one rank, else local), inline (this process), local (nproc processes here), slurm; torchrun: set by `train` under torchrun."""
    nproc: int = 1
    """Processes (ranks) per node."""
    nnodes: int = 1
    """Nodes of the job (world size = nnodes x nproc); local with several: one `train` per node (docs/multinode.md)."""
    node_rank: int = 0
    """This node of a multi-node local job (torchrun --node_rank): node 0 hosts the rendezvous and writes the run directory; spec.yaml records 0."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of node 0's rendezvous in a multi-node local job (torchrun --rdzv_endpoint); node 0 listens on HOST only."""
    rdzv_id: str | None = None
    """Id of a multi-node local job, the same on every node (torchrun --rdzv_id); null: derived from run_dir."""
    device: str = "auto"
    """auto (a GPU when one is visible, else the CPU), cpu or cuda."""
    max_restarts: int = 0
    """Times a failed job is restarted from its newest checkpoint (needs checkpoints)."""
    master_addr: str = "127.0.0.1"
    """Rendezvous host of a single-node job (several nodes: rdzv_endpoint)."""
    master_port: int | None = None
    """Rendezvous port; null picks a free one."""
    timeout_s: float = 300.0
    """Timeout of collectives and of the rendezvous; a rank that does not answer fails the job."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """Resources and preemption settings of the batch job (backend slurm only)."""

    @property
    def world_size(self) -> int:
        """Ranks of the job: nnodes x nproc (computed here, and only here)."""
        return self.nnodes * self.nproc


def resolve_backend(config: LauncherConfig) -> str:
    """`auto` becomes inline for a one-rank job without restarts, local otherwise; others pass through."""
    if config.backend != "auto":
        return config.backend
    multi = config.world_size > 1 or config.max_restarts > 0
    return "local" if multi else "inline"


TIME_FORMATS = "minutes (90), MM:SS, HH:MM:SS (1:30:00), D-HH, D-HH:MM or D-HH:MM:SS (2-00:00:00)"
"""The time formats sbatch --time accepts, as error messages name them."""

_TIME = re.compile(
    r"(?:(?P<days>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)"
)


def time_limit_s(value: str | int | None) -> int | None:
    """Seconds of an sbatch-style time limit (None for null); ValueError when it is not one of TIME_FORMATS."""
    if value is None:
        return None
    text = str(value).strip()
    match = _TIME.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a time limit")
    g = {k: int(v) for k, v in match.groupdict().items() if v is not None}
    if "days" in g:
        return ((g["days"] * 24 + g["dh"]) * 60 + g.get("dm", 0)) * 60 + g.get("ds", 0)
    if "c" in g:  # HH:MM:SS
        return (g["a"] * 60 + g["b"]) * 60 + g["c"]
    return g["a"] * 60 + g.get("b", 0)  # minutes, or MM:SS


def time_limit_min(value: str | int | None) -> int | None:
    """Whole minutes of an sbatch-style time limit, rounded up as sbatch does."""
    seconds = time_limit_s(value)
    return None if seconds is None else math.ceil(seconds / 60)


def torchrun_world(env: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """(nproc, nnodes) of the torchrun job this process belongs to, from torch elastic's variables; None outside one.

    Under `torchrun --nproc_per_node=N --nnodes=M -m launcher ...` every process composes the spec, and
    launcher.nproc/nnodes must record N and M (the true world size), not the defaults.
    """
    if "TORCHELASTIC_RUN_ID" not in env or "LOCAL_WORLD_SIZE" not in env:
        return None
    nproc = int(env["LOCAL_WORLD_SIZE"])
    world = int(env.get("WORLD_SIZE", nproc))
    return nproc, max(1, world // max(1, nproc))
