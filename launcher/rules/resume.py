"""Rules of resuming: a fresh start never mixes runs, the checkpoint exists and its layout fits this spec."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from launcher.groups import checkpoint
from launcher.parallel.deepspeed import TAG
from launcher.parallel.dtensor import is_dcp_checkpoint
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError

DTENSOR_STRATEGIES = ("fsdp", "tp")


def _resume(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    run_dir = Path(spec.run_dir) if spec.run_dir else None
    if spec.resume is None:
        if run_dir is not None and checkpoint.step_dirs(run_dir):
            yield SpecError(
                ("resume", "run_dir"),
                f"{run_dir} already holds checkpoints and resume is null, so a fresh start would mix two "
                "runs. Continue it with `resume=auto`, or choose another run_dir.",
            )
        return
    if spec.resume == "auto":
        if run_dir is None:
            yield SpecError(
                ("resume", "run_dir"),
                "resume=auto continues the run in run_dir, but run_dir is null (a new directory per run). "
                "Name the run directory, e.g. `run_dir=runs/my-run resume=auto`.",
            )
        return
    if not checkpoint.resolve_resume(spec.resume, None):
        yield SpecError(
            ("resume",),
            f"'{spec.resume}' holds no complete checkpoint (a run directory with checkpoints/step_N, or a "
            "step_N directory with its COMPLETE marker). Give another path, or `resume=auto`.",
        )


def _num_checkpoint_ranks(path: Path) -> int:
    """Ranks that wrote a checkpoint (each leaves its RNG state file)."""
    return len(list(path.glob("rng_rank*.pt")))


def _checkpoint_to_resume(spec: RunSpec) -> Path | None:
    """The newest complete checkpoint `resume` names, None when it names none (or resume is null)."""
    run_dir = Path(spec.run_dir) if spec.run_dir else None
    if spec.resume is None or (spec.resume == "auto" and run_dir is None):
        return None
    found = checkpoint.resolve_resume(spec.resume, run_dir)
    return found[0] if found else None


def _resume_layout(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    newest = _checkpoint_to_resume(spec)
    if newest is None:
        return
    strategy = spec.parallel.strategy
    sharded, world = is_dcp_checkpoint(newest), spec.launcher.world_size
    num_ranks = _num_checkpoint_ranks(newest)
    if sharded and strategy not in DTENSOR_STRATEGIES:
        yield SpecError(
            ("resume", "parallel.strategy"),
            f"{newest} is a sharded (DCP) checkpoint of strategy fsdp or tp, which parallel.strategy={strategy} "
            "cannot read. Resume with `parallel=fsdp` or `parallel=tp` (DCP reshards to fewer ranks), or convert its "
            f"weights to a full state dict (loads at world size 1) with `train-export {newest} weights.pt`.",
        )
    elif not sharded and strategy in DTENSOR_STRATEGIES:
        yield SpecError(
            ("resume", "parallel.strategy"),
            f"{newest} was not written by fsdp or tp (it holds no dcp/ shards), so parallel.strategy={strategy} "
            "cannot resume it. Resume it with the strategy that wrote it, or convert its weights to a full state "
            f"dict with `train-export {newest} weights.pt`.",
        )
    elif sharded and world > num_ranks > 0:
        yield SpecError(
            ("resume", "launcher.nproc", "launcher.nnodes"),
            f"{newest} was written by {num_ranks} rank(s) and this run has {world}: DCP reshards the "
            "model and optimizer to fewer ranks, but the extra ranks would have no RNG state to continue from. "
            f"Resume with at most {num_ranks} ranks, or convert its weights to a full state dict "
            f"with `train-export {newest} weights.pt`.",
        )


def _resume_world_size(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    newest = _checkpoint_to_resume(spec) if spec.parallel.strategy == "deepspeed" else None
    if newest is None:
        return
    num_shards = len(list((newest / TAG).glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt")))
    world = spec.launcher.world_size
    if num_shards and num_shards != world:
        yield SpecError(
            ("resume", "launcher.nproc"),
            f"{newest} holds ZeRO state sharded over {num_shards} ranks, but this run has {world}. "
            f"Resume with launcher.nproc={num_shards} (x launcher.nnodes), or convert: `train-export "
            f"{newest} model.pt` writes the full fp32 weights, which load at any world size.",
        )


def _verify_resume(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    if not spec.verify_resume:
        return
    if spec.resume is not None:
        yield SpecError(
            ("verify_resume", "resume"),
            "verify_resume runs the spec from scratch (twice, in fresh subdirectories); drop `resume`.",
        )
    if spec.train.stop_after is not None:
        yield SpecError(
            ("verify_resume", "train.stop_after"),
            "verify_resume sets train.stop_after itself (to half of train.max_steps); leave it null.",
        )
    if spec.train.max_steps < 2:
        yield SpecError(
            ("verify_resume", "train.max_steps"),
            f"the check stops at max_steps/2 and resumes, which needs train.max_steps >= 2 (got {spec.train.max_steps}).",
        )


RULES: tuple[Rule, ...] = (_resume, _resume_layout, _resume_world_size, _verify_resume)
"""This module's rules, in the order they report."""
