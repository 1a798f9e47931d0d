"""Rules for multi-process jobs: world size against strategy and devices, restarts, rendezvous."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.parallel.registry import STRATEGIES
from launcher.rules.core import Hardware, rule
from launcher.spec import RunSpec, SpecError


def world_size(spec: RunSpec) -> int:
    """Ranks of the job: nodes x processes per node."""
    return spec.launcher.nnodes * spec.launcher.nproc


@rule
def _strategy_fits_world(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    n = world_size(spec)
    if spec.parallel.strategy == "single" and n > 1:
        others = ", ".join(f"parallel={s}" for s in sorted(STRATEGIES) if s != "single")
        yield SpecError(
            ("parallel.strategy", "launcher.nproc", "launcher.nnodes"),
            f"parallel=single keeps one copy of the model on one rank, but the job has {n} ranks "
            f"(launcher.nnodes={spec.launcher.nnodes} x launcher.nproc={spec.launcher.nproc}). "
            f"Pick a multi-rank strategy ({others}), or set launcher.nproc=1.",
        )


@rule
def _launch_settings(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    lc = spec.launcher
    if lc.nnodes < 1:
        yield SpecError(("launcher.nnodes",), f"must be at least 1, got {lc.nnodes}.")
    if lc.max_restarts < 0:
        yield SpecError(("launcher.max_restarts",), f"must be 0 or more, got {lc.max_restarts}.")
    if lc.timeout_s <= 0:
        yield SpecError(("launcher.timeout_s",), f"must be positive, got {lc.timeout_s}; e.g. 300.")
    if lc.master_port is not None and not 1 <= lc.master_port <= 65535:
        yield SpecError(
            ("launcher.master_port",),
            f"{lc.master_port} is not a TCP port (1-65535); use null to pick a free one.",
        )
    if lc.backend == "local" and lc.nnodes > 1:
        yield SpecError(
            ("launcher.backend", "launcher.nnodes"),
            f"the local backend starts ranks on this machine only, but launcher.nnodes={lc.nnodes}. "
            "Use `launcher=slurm` for several nodes, or launcher.nnodes=1.",
        )


@rule
def _restarts_need_checkpoints(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    lc = spec.launcher
    if lc.max_restarts > 0 and spec.checkpoint.every is None:
        yield SpecError(
            ("launcher.max_restarts", "checkpoint.every"),
            f"launcher.max_restarts={lc.max_restarts} restarts a failed job from its newest checkpoint, "
            "but checkpoint.every=null writes none during the run, so every restart would begin at "
            "step 0. Set checkpoint.every (e.g. 100), or launcher.max_restarts=0.",
        )
    if lc.max_restarts > 0 and lc.backend == "inline":
        yield SpecError(
            ("launcher.max_restarts", "launcher.backend"),
            "the inline backend runs the job in this process and cannot restart it. Use "
            "`launcher=local` (its elastic agent restarts the ranks), or launcher.max_restarts=0.",
        )


@rule
def _ranks_fit_devices(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    nproc = spec.launcher.nproc
    if hw.device_type == "cuda" and spec.launcher.backend != "inline" and nproc > hw.num_gpus:
        yield SpecError(
            ("launcher.nproc", "launcher.device"),
            f"launcher.nproc={nproc} ranks per node need one GPU each, but {hw.num_gpus} are visible "
            f"(CUDA_VISIBLE_DEVICES). Set launcher.nproc={hw.num_gpus} or less, or launcher.device=cpu.",
        )
