"""Rules of resuming: a fresh start never mixes runs, the checkpoint exists and its layout fits this spec.

Which strategy wrote a checkpoint is read from its run directory's spec.yaml (as train-export does,
but as plain YAML: two keys, no interpolation, whatever schema wrote it); a pipeline's (pp_size > 1,
or strategy pp) checkpoint is resumed only by a pipeline, and a pipeline resumes only a pipeline's
checkpoints (DCP under the whole model's names, whichever data-parallel wrap its stages had)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import yaml

from launcher.components import checkpoint
from launcher.parallel.checkpoint_layout import TAG, is_dcp_checkpoint
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError

DTENSOR_STRATEGIES = ("fsdp", "tp")
DCP_STRATEGIES = (*DTENSOR_STRATEGIES, "pp")
"""Strategies whose checkpoints are DCP shards (a pipeline's past _pipeline_boundary is pp's own)."""


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


def _num_zero_shards(path: Path) -> int:
    """Ranks a DeepSpeed checkpoint's ZeRO optimizer state is sharded over (0: it holds none)."""
    return len(list((path / TAG).glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt")))


def _checkpoint_to_resume(spec: RunSpec) -> Path | None:
    """The newest complete checkpoint `resume` names, None when it names none (or resume is null)."""
    run_dir = Path(spec.run_dir) if spec.run_dir else None
    if spec.resume is None or (spec.resume == "auto" and run_dir is None):
        return None
    found = checkpoint.resolve_resume(spec.resume, run_dir)
    return found[0] if found else None


def written_by(step_dir: Path) -> str | None:
    """The parallel.strategy of the run that wrote a checkpoint, from its run directory's spec.yaml (None: unknown)."""
    parallel = _written_parallel(step_dir)
    strategy = parallel.get("strategy") if parallel else None
    return strategy if isinstance(strategy, str) else None


def _written_parallel(step_dir: Path) -> dict | None:
    """The parallel section of the spec.yaml beside a checkpoint (None: none readable)."""
    try:
        raw = yaml.safe_load((Path(step_dir).parent.parent / "spec.yaml").read_text())
        parallel = raw["parallel"]
    except (OSError, yaml.YAMLError, TypeError, KeyError):
        return None
    return parallel if isinstance(parallel, dict) else None


def _pipelined(strategy: str | None, pp_size: object) -> bool:
    """Whether a run of `strategy` with `pp_size` cuts the model into pipeline stages."""
    return strategy == "pp" or (isinstance(pp_size, int) and pp_size > 1)


def _pipeline_boundary(newest: Path, spec: RunSpec, sharded: bool) -> Iterator[SpecError]:
    """A checkpoint crosses between a pipeline and the other layouts only through exported weights."""
    strategy = spec.parallel.strategy
    written = _written_parallel(newest)
    writer = written_by(newest)
    if writer is None and sharded:
        return  # no spec.yaml beside it: fsdp, tp and pipelines all write DCP shards, so it cannot be told
    # without a spec.yaml, a full (non-DCP) checkpoint is not a pipeline's
    by_pipeline = _pipelined(writer, (written or {}).get("pp_size", 1))
    if by_pipeline == _pipelined(strategy, spec.parallel.pp_size):
        return
    run_dir = newest.parent.parent
    export = (
        f"export its weights (`train-export {run_dir} OUT --format hf`, or `train-export {run_dir} weights.pt`) "
        "and start a new run from them (e.g. `model=hf model.path=OUT`)"
    )
    if by_pipeline:
        yield SpecError(
            ("resume", "parallel.strategy"),
            f"{newest} was written by strategy {writer} with pipeline stages (a pipeline, says {run_dir}/spec.yaml), "
            f"and only a pipeline resumes it, not parallel.strategy={strategy} without one. Resume it with "
            f"parallel.pp_size=2 or more (any pp_size and pp_schedule: its DCP keys are the whole model's), or {export}.",
        )
    else:
        yield SpecError(
            ("resume", "parallel.strategy"),
            f"{newest} was written by strategy {writer or 'single, ddp or deepspeed (it holds no dcp/ shards)'}, "
            "and a pipeline (parallel.pp_size > 1) resumes only a pipeline's checkpoints. Resume it with the "
            f"layout that wrote it, or {export} under the pipeline.",
        )


def _resume_layout(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    newest = _checkpoint_to_resume(spec)
    if newest is None:
        return
    strategy = spec.parallel.strategy
    sharded, world = is_dcp_checkpoint(newest), spec.launcher.world_size
    num_ranks = _num_checkpoint_ranks(newest)
    num_shards = _num_zero_shards(newest) if strategy == "deepspeed" else 0
    crossing = list(_pipeline_boundary(newest, spec, sharded))
    if crossing:
        yield from crossing
        return
    pipelined = _pipelined(strategy, spec.parallel.pp_size)
    if sharded and strategy not in DCP_STRATEGIES and not pipelined:
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
    elif num_shards and num_shards != world:
        yield SpecError(
            ("resume", "launcher.nproc"),
            f"{newest} holds ZeRO state sharded over {num_shards} ranks, but this run has {world}. "
            f"Resume with launcher.nproc={num_shards} (x launcher.nnodes), or convert: `train-export "
            f"{newest} model.pt` writes the full fp32 weights, which load at any world size.",
        )
    elif sharded and world > num_ranks > 0:
        yield SpecError(
            ("resume", "launcher.nproc", "launcher.nnodes"),
            f"{newest} was written by {num_ranks} rank(s) and this run has {world}: DCP reshards the "
            "model and optimizer to fewer ranks, but the extra ranks would have no RNG state to continue from. "
            f"Resume with at most {num_ranks} ranks, or convert its weights to a full state dict "
            f"with `train-export {newest} weights.pt`.",
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


RULES: tuple[Rule, ...] = (_resume, _resume_layout, _verify_resume)
"""This module's rules, in the order they report."""
