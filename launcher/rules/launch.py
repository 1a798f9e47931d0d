"""Rules of the launcher group: devices, ranks against strategy and GPUs, restarts, rendezvous settings.

Whether a live run holds the run directory is its lock's to say, read before launch: launcher.front.compose.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, positive
from launcher.spec import RunSpec, SpecError

MULTI_RANK_OPTIONS = "parallel=ddp, fsdp, tp (tensor parallel), zero0 ... zero3 (DeepSpeed ZeRO)"
"""The `parallel` options that run on several ranks (as `train --help` lists them)."""
LOCAL_RANKS_PER_CORE = 8
"""The most local ranks per CPU core this machine is asked to start (more only wait on each other)."""
SIMULATED_MAX = 4096
"""The most ranks dry_run=simulate lays out (its fake process group grows with them: 2,048 FSDP ranks take
about half a minute on two cores); dry_run=true plans any size."""


def _hardware(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    if spec.launcher.device == "cuda" and hw.missing_gpu:  # slurm: rules/slurm.py
        yield SpecError(
            ("launcher.device",),
            "launcher.device=cuda but no CUDA GPU is visible to this process, and the run would start here. "
            "Use `launcher.device=auto` or `cpu`, run on a machine with a GPU, or plan the GPU run from here "
            "with `dry_run=true simulate_hardware=h100_sxm` (a100_80g, h100_hbm2e, h200), which starts nothing.",
        )
    yield from positive("launcher.nproc", spec.launcher.nproc)
    if spec.launcher.backend == "inline" and spec.launcher.nproc > 1:
        yield SpecError(
            ("launcher.backend", "launcher.nproc"),
            f"the inline backend runs one process, but launcher.nproc={spec.launcher.nproc}. "
            "Use `launcher=local` for several processes on this machine, or launcher.nproc=1.",
        )


def _strategy_fits_world(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    n, stages = spec.launcher.world_size, max(spec.parallel.pp_size, 1)
    cp = max(spec.parallel.cp_size, 1)
    if spec.parallel.strategy == "single" and n > stages * cp:
        held = (
            "the model on one rank"
            if stages == 1
            else f"each of the {stages} pipeline ranks' stages on one rank"
        )
        if cp > 1:
            held += f" (or on each of parallel.cp_size={cp} context-parallel ranks)"
            stages = cp
        yield SpecError(
            ("parallel.strategy", "launcher.nproc", "launcher.nnodes"),
            f"parallel=single keeps one copy of {held}, but the job has {n} ranks "
            f"(launcher.nnodes={spec.launcher.nnodes} x launcher.nproc={spec.launcher.nproc}). "
            f"Pick a multi-rank option: {MULTI_RANK_OPTIONS}; or set launcher.nproc={stages}.",
        )


def _ranks_this_machine_starts(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    """A local job starts launcher.nproc processes here: not more than the cores can carry; a simulation is bounded too."""
    nproc, cores = spec.launcher.nproc, len(os.sched_getaffinity(0))
    if spec.dry_run == "simulate":
        if spec.launcher.world_size > SIMULATED_MAX:
            yield SpecError(
                ("dry_run", "launcher.nproc", "launcher.nnodes"),
                f"dry_run=simulate lays out every rank of the job on one fake process group, and "
                f"{spec.launcher.world_size:,} ranks would take hours (at most {SIMULATED_MAX:,}). Use "
                "dry_run=true for the planner's estimate at this size, or simulate fewer ranks of the same shape "
                "(the memory of a rank depends on the degrees it is sharded over, not on the job's size).",
            )
        return
    limit = max(LOCAL_RANKS_PER_CORE * cores, hw.num_gpus)
    if spec.launcher.backend == "local" and nproc > limit:
        yield SpecError(
            ("launcher.nproc", "launcher.backend"),
            f"launcher.nproc={nproc:,} processes would start on this machine, which has {cores} CPU core(s): "
            f"at most {limit} ({LOCAL_RANKS_PER_CORE} per core) start here. For more ranks use launcher=slurm, "
            "or several machines (launcher.nnodes, docs/multinode.md); to plan a large job without starting "
            "anything, dry_run=simulate.",
        )


def _names_of_the_run(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    """The run's name and directory: usable as a path."""
    name = spec.name
    if not name.strip() or name in (".", "..") or "/" in name or any(c in name for c in "\n\r\0"):
        yield SpecError(
            ("name",),
            f"{name!r} cannot name a run directory: give a non-empty name without '/', e.g. name=lr3e-4.",
        )
    if spec.run_dir is not None and not spec.run_dir.strip():
        yield SpecError(
            ("run_dir",),
            "run_dir is empty: give a directory (e.g. run_dir=runs/exp1), or leave it unset (null) for "
            "runs/<name>-<timestamp>.",
        )


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
    yield from _nodes_of_a_local_job(spec)


def _nodes_of_a_local_job(spec: RunSpec) -> Iterator[SpecError]:
    """Several nodes under the local backend: one `train` per node, joined at node 0's rendezvous."""
    lc = spec.launcher
    if lc.nnodes <= 1 or lc.backend != "local":
        if lc.node_rank != 0 or lc.rdzv_endpoint is not None:
            yield SpecError(
                ("launcher.node_rank", "launcher.rdzv_endpoint", "launcher.nnodes"),
                f"launcher.node_rank and launcher.rdzv_endpoint join a multi-node local job, but this one has "
                f"launcher.nnodes={lc.nnodes} with launcher.backend={lc.backend}. Use `launcher=local "
                "launcher.nnodes=N launcher.node_rank=K launcher.rdzv_endpoint=HOST:PORT` on each node, or drop "
                "them (one node rendezvous on launcher.master_addr; SLURM places nodes itself).",
            )
        return
    if not 0 <= lc.node_rank < lc.nnodes:
        yield SpecError(
            ("launcher.node_rank",),
            f"launcher.node_rank={lc.node_rank} but the job has launcher.nnodes={lc.nnodes} nodes: give each "
            f"node one of 0..{lc.nnodes - 1} (node 0 hosts the rendezvous).",
        )
    host, _, port = (lc.rdzv_endpoint or "").rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        yield SpecError(
            ("launcher.rdzv_endpoint",),
            f"launcher.nnodes={lc.nnodes} needs launcher.rdzv_endpoint=HOST:PORT, node 0's address and a free "
            f"port (e.g. 10.0.0.1:29400), the same on every node; got {lc.rdzv_endpoint!r}.",
        )
    if spec.verify_resume:
        yield SpecError(
            ("verify_resume", "launcher.nnodes"),
            f"verify_resume=true starts runs of its own, which the other {lc.nnodes - 1} node(s) of a "
            "multi-node local job cannot follow. Check resume on one node (launcher.nnodes=1), then run "
            "the nodes without it.",
        )
    if spec.run_dir is None or not spec.run_dir.strip():
        yield SpecError(
            ("run_dir",),
            f"the {lc.nnodes} nodes of the job must be told one run directory: give run_dir=PATH, a path on a "
            "filesystem every node shares (checkpoints and spec.yaml live there).",
        )


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


def _ranks_fit_devices(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    nproc = spec.launcher.nproc
    if hw.requested or hw.device_type != "cuda" or spec.launcher.backend == "inline" or nproc <= hw.num_gpus:
        return  # a SLURM job's GPUs per node are rules/slurm.py's to judge
    if hw.missing_gpu:
        return  # no GPU at all: _hardware says so
    fix = (
        f"Set launcher.nproc={hw.num_gpus} or less"
        if hw.num_gpus
        else "Run on a machine with GPUs (or submit with `launcher=slurm launcher.slurm.gpus_per_node=N`)"
    )
    yield SpecError(
        ("launcher.nproc", "launcher.device"),
        f"launcher.nproc={nproc} ranks per node need one GPU each, but {hw.num_gpus} are visible "
        f"(CUDA_VISIBLE_DEVICES). {fix}, or use launcher.device=cpu.",
    )


PSEUDO_FILESYSTEMS = (Path("/proc"), Path("/sys"))
"""Kernel interfaces that look like folders but hold no files of ours."""


def run_dir_problem(run_dir: Path) -> str | None:
    """Why `run_dir` cannot be created and written here (nothing is created to find out), or None."""
    path = Path(os.path.abspath(run_dir.expanduser()))
    if path.exists() and not path.is_dir():
        return f"{path} exists and is not a directory. Give run_dir a directory, or move the file away."
    existing = next(p for p in (path, *path.parents) if p.exists())
    if any(existing == p or p in existing.parents for p in PSEUDO_FILESYSTEMS):
        return f"{path} lies in {existing}, a kernel interface that cannot hold files. Give run_dir a real directory."
    if not existing.is_dir():
        return f"{existing} is a file, so {path} cannot be created under it. Give run_dir another path."
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user, so {path} cannot be created there. Give run_dir a path you can write."
    return None


def _run_dir_writable(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    """The run directory can be made and written (node 0 makes it; other nodes only read it)."""
    if spec.run_dir is not None and spec.run_dir.strip() and spec.launcher.node_rank == 0:
        problem = run_dir_problem(Path(spec.run_dir))
        if problem is not None:
            yield SpecError(("run_dir",), problem)


RULES: tuple[Rule, ...] = (
    _names_of_the_run,
    _hardware,
    _ranks_this_machine_starts,
    _strategy_fits_world,
    _launch_settings,
    _restarts_need_checkpoints,
    _ranks_fit_devices,
    _run_dir_writable,
)
"""This module's rules, in the order they report."""
