"""`torchrun --nproc_per_node=N [--nnodes=M ...] -m launcher ARGS`: torch's launcher started the ranks.

Every process composes and validates the same command line, so every one refuses a bad spec
itself (exit 2, nothing started). The spec records torchrun's world: launcher.nproc and
launcher.nnodes from torch elastic's variables, launcher.backend=torchrun. Global rank 0 alone
tokenizes, takes the run directory's lock and writes spec.yaml; the other ranks wait until
spec.yaml holds exactly the spec they composed, then each runs its rank from it, as ranks
started by `train` do. The run directory must be given and, across nodes, shared.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from omegaconf import DictConfig

from launcher.config.launcher import torchrun_world
from launcher.exits import ExitStatus
from launcher.front import compose, join, rundir
from launcher.front.config_values import with_values
from launcher.front.tokenize import prepare_data
from launcher.spec import SpecError


def active(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is a rank that torchrun started."""
    return torchrun_world(env) is not None


def reports(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process reports spec problems: always outside torchrun, global rank 0 only under it."""
    return not active(env) or int(env.get("RANK", "0")) == 0


def adopt(
    cfg: DictConfig, *, multirun: bool = False, env: Mapping[str, str] = os.environ
) -> tuple[DictConfig, list[SpecError]]:
    """The composed config with torchrun's world recorded; what conflicts with it.

    Outside torchrun, only a spec that names the torchrun backend is a problem.
    """
    lc = cfg.launcher
    world = torchrun_world(env)
    if world is None:
        if lc.backend == "torchrun":
            return cfg, [
                SpecError(
                    ("launcher.backend",),
                    "launcher.backend=torchrun means torchrun started this process, but it did not (no "
                    "TORCHELASTIC_RUN_ID). Run it as `torchrun --nproc_per_node=N -m launcher ...`, or let "
                    "`train` start the ranks: launcher=local launcher.nproc=N.",
                )
            ]
        return cfg, []
    nproc, nnodes = world
    errors = []
    if lc.backend not in ("auto", "torchrun"):
        errors.append(
            SpecError(
                ("launcher.backend",),
                f"this process was started by torchrun, which already started the job's ranks, but "
                f"launcher.backend={lc.backend} would start them again. Drop launcher={lc.backend} (under "
                "torchrun the launcher group stays at its default), or run `train` without torchrun.",
            )
        )
    for key, ours, theirs, flag in (("nproc", lc.nproc, nproc, "--nproc_per_node"), ("nnodes", lc.nnodes, nnodes, "--nnodes")):  # fmt: skip
        if ours not in (1, theirs):
            errors.append(
                SpecError(
                    (f"launcher.{key}",),
                    f"launcher.{key}={ours} but torchrun started {theirs} ({flag}={theirs}). Under torchrun "
                    f"the world comes from torchrun's flags: drop launcher.{key}.",
                )
            )
    if lc.max_restarts:
        errors.append(
            SpecError(
                ("launcher.max_restarts",),
                f"launcher.max_restarts={lc.max_restarts} restarts ranks that `train` starts; under torchrun, "
                "torchrun restarts them: use `torchrun --max-restarts=N` (each restart resumes from the newest "
                "checkpoint) and drop launcher.max_restarts.",
            )
        )
    if multirun or cfg.get("verify_resume"):
        what = "--multirun" if multirun else "verify_resume=true"
        errors.append(
            SpecError(
                ("verify_resume",) if not multirun else ("--multirun",),
                f"{what} starts runs of its own, which torchrun's ranks cannot share. Run it without "
                "torchrun, with `train` starting the ranks: launcher=local launcher.nproc=N.",
            )
        )
    if not cfg.get("run_dir"):
        errors.append(
            SpecError(
                ("run_dir",),
                "under torchrun every rank composes the run, so they must be told one run directory: give "
                "run_dir=PATH (a path every node sees: a shared filesystem across nodes).",
            )
        )
    if errors:
        return cfg, errors
    world_values = {"launcher.backend": "torchrun", "launcher.nproc": nproc, "launcher.nnodes": nnodes}
    if int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 and cfg.get("resume") is None:
        world_values["resume"] = "auto"  # torchrun restarted the job: continue from its newest checkpoint
    return with_values(cfg, world_values), []


def start(built: compose.Built, run_dir: Path, env: Mapping[str, str] = os.environ) -> int:
    """Run this process's rank of a validated spec; global rank 0 writes the run directory first."""
    if int(env.get("RANK", "0")) == 0:
        errors = prepare_data(built.spec)  # tokenize once, before the other ranks read the cache
        if errors:
            rundir.report(errors)
            return ExitStatus.INVALID_SPEC
        return rundir.start(built, run_dir)
    spec, expected = built.written(run_dir)  # what rundir.write makes of it on rank 0
    path = run_dir / "spec.yaml"
    if not join.wait_for_spec(path, expected, spec.launcher.timeout_s):
        rundir.err_console.print(
            f"error: rank {env.get('RANK')} waited {spec.launcher.timeout_s:.0f} s (launcher.timeout_s) for "
            f"rank 0 to write {path} with the spec this rank composed, and it did not. Rank 0 failed (its "
            "error comes first), the ranks were given different command lines, or the run directory is "
            "not shared between the nodes (it must be: a shared filesystem path).",
            markup=False,
            soft_wrap=True,
        )
        return ExitStatus.FAILED
    from launcher.launch import backend

    return backend("torchrun").launch(spec, run_dir)
