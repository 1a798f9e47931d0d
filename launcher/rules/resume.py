"""Rules of resuming: a fresh start never mixes runs, the checkpoint exists and its layout fits this spec.

Which strategy wrote a checkpoint, and how its data was laid out, is read from its run directory's
spec.yaml (as train-export does, but as plain YAML: a few keys, no interpolation, whatever schema
wrote it). What resumes what (launcher.parallel.part_state, state_convert):

- single, ddp, fsdp and tp resume each other's checkpoints (model.pt files or dcp/ shards) on any
  number of ranks: DCP reshards, files are sharded from rank 0 or read whole;
- a DeepSpeed checkpoint resumes under DeepSpeed on the world size that wrote it, or under any
  other strategy on any number of ranks with its fp32 weights (the optimizer state restarts);
  DeepSpeed resumes nothing else;
- a pipeline's (pp_size > 1, or strategy pp) checkpoint is resumed only by a pipeline, and a
  pipeline resumes only a pipeline's checkpoints (DCP under the whole model's names);
- the data position carries over only where the new layout maps it exactly (`data_position`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import yaml

from launcher.components import checkpoint
from launcher.parallel.checkpoint_layout import OPTIMIZER_RESTARTS, TAG, checkpoint_kind, is_dcp_checkpoint
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError


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


def _written_spec(step_dir: Path) -> dict | None:
    """The spec.yaml beside a checkpoint as plain YAML (None: none readable)."""
    try:
        raw = yaml.safe_load((Path(step_dir).parent.parent / "spec.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return raw if isinstance(raw, dict) else None


def _written_parallel(step_dir: Path) -> dict | None:
    """The parallel section of the spec.yaml beside a checkpoint (None: none readable)."""
    parallel = (_written_spec(step_dir) or {}).get("parallel")
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
    crossing = list(_pipeline_boundary(newest, spec, is_dcp_checkpoint(newest)))
    if crossing:
        yield from crossing
        return
    yield from _deepspeed_fit(newest, spec)
    yield from data_position(newest, spec)


def _deepspeed_fit(newest: Path, spec: RunSpec) -> Iterator[SpecError]:
    """DeepSpeed resumes only its own ZeRO files at their world size; its weights carry into the other strategies."""
    kind, strategy, world = checkpoint_kind(newest), spec.parallel.strategy, spec.launcher.world_size
    others = "single, ddp, fsdp or tp"
    if strategy == "deepspeed" and kind != "deepspeed":
        yield SpecError(
            ("resume", "parallel.strategy"),
            f"{newest} was written by {written_by(newest) or others} (it holds no DeepSpeed files), and DeepSpeed "
            "resumes only its own checkpoints: its ZeRO optimizer state cannot be built from another layout. "
            f"Resume it with any of {others} (on any number of ranks), or export its weights (`train-export "
            f"{newest} weights.pt`) and start a new DeepSpeed run from them.",
        )
    elif strategy == "deepspeed" and 0 < _num_zero_shards(newest) != world:
        num_shards = _num_zero_shards(newest)
        yield SpecError(
            ("resume", "launcher.nproc"),
            f"{newest} holds ZeRO state sharded over {num_shards} ranks, but this run has {world}, and DeepSpeed "
            f"resumes ZeRO state only on the world size that wrote it. Resume with launcher.nproc={num_shards} "
            f"(x launcher.nnodes), or resume it with another strategy (parallel=ddp, fsdp, tp or single) on "
            f"{world} rank(s): its fp32 weights carry over, {OPTIMIZER_RESTARTS}.",
        )
    elif kind == "deepspeed" and strategy != "deepspeed" and spec.quantization.lora.rank > 0:
        yield SpecError(
            ("resume", "parallel.strategy", "quantization.lora.rank"),
            f"{newest} is a DeepSpeed checkpoint of an adapter run, which only DeepSpeed resumes. Resume it with "
            f"`parallel=deepspeed` (launcher.nproc={_num_checkpoint_ranks(newest)}), or merge its adapters with "
            "`train-merge` and start a new run from the merged weights.",
        )


def _global_batch(train: dict, dp_size: int) -> tuple[int, int, int]:
    """(micro batch, accumulation, sequences per optimizer step) of a spec's train section on dp_size ranks."""
    micro, accum = int(train.get("micro_batch_size", 0)), int(train.get("grad_accum_steps", 1))
    return micro, accum, micro * accum * dp_size


def _dp_size(parallel: dict, world: int) -> int:
    """Data-parallel ranks of `world` ranks under a parallel section (tensor, context and pipeline ranks read one batch)."""
    per_batch = int(parallel.get("tp_size", 1) or 1) * int(parallel.get("pp_size", 1) or 1)
    per_batch *= int(parallel.get("cp_size", 1) or 1)
    return max(world // per_batch, 1)


def data_position(newest: Path, spec: RunSpec) -> Iterator[SpecError]:
    """The data stream continues at the checkpoint's global position only where the new layout maps it exactly.

    A stream's position counts global sequences (packed, padded) or draws (a mixture), the same on
    every rank; packed and padded streams test for an epoch's end before every optimizer step
    (counted in micro batches, not by the offset), so any global batch continues the epoch where it
    stopped; length grouping sorts within groups of global micro batches,
    so the global micro batch must stay too; token-budget batches are cut per rank, so the
    data-parallel size must stay. A mixture's draws map to any layout.
    """
    written = _written_spec(newest)
    world, num_ranks = spec.launcher.world_size, _num_checkpoint_ranks(newest)
    train = (written or {}).get("train")
    if not isinstance(train, dict) or "micro_batch_size" not in train:
        if num_ranks and num_ranks != world:
            yield SpecError(
                ("resume", "launcher.nproc"),
                f"{newest} was written by {num_ranks} rank(s), this run has {world}, and no spec.yaml beside it "
                "(with its train section) says how its data was laid out, so the data position cannot be carried "
                f"to another world size. Resume with {num_ranks} rank(s) (launcher.nproc), or restore its run "
                "directory's spec.yaml.",
            )
        return
    old_dp = _dp_size(written.get("parallel") or {}, num_ranks or world)
    new_dp = _dp_size(vars(spec.parallel), world)
    old = _global_batch(train, old_dp)
    t = spec.train
    new = (t.micro_batch_size, t.grad_accum_steps, t.micro_batch_size * t.grad_accum_steps * new_dp)
    if spec.data.sources or (old, old_dp) == (new, new_dp):
        return
    yield from _unmapped(newest, spec, (*old, old_dp), (*new, new_dp), num_ranks)


def _unmapped(newest: Path, spec: RunSpec, old: tuple, new: tuple, num_ranks: int) -> Iterator[SpecError]:
    """Why the position of a checkpoint of layout `old` has no exact place in layout `new`, if it has none.

    Each layout is (micro batch, accumulation, sequences per step, data-parallel ranks).
    """
    old_dp, new_dp, world = old[3], new[3], spec.launcher.world_size
    keys = ("resume", "train.micro_batch_size", "train.grad_accum_steps", "launcher.nproc")
    was = f"{old[0]} x {old[1]} accumulated x {old_dp} data-parallel ranks"
    if (
        spec.data.batching == "token_budget"
        and not spec.data.packing
        and (old_dp, old[1]) != (new_dp, new[1])
    ):
        yield SpecError(
            keys,
            f"{newest} was written with token-budget batches on {old_dp} data-parallel rank(s) and "
            f"train.grad_accum_steps={old[1]}; those batches are cut per rank, so its data position has no exact "
            f"place on {new_dp} rank(s) or another accumulation. Resume with {old_dp * (world // new_dp)} ranks and "
            f"train.grad_accum_steps={old[1]}, or start a new run from its exported weights.",
        )
    elif (
        spec.data.batching == "group_by_length"
        and not spec.data.packing
        and old[0] * old_dp != new[0] * new_dp
    ):
        yield SpecError(
            keys,
            f"{newest} was written with length-grouped batches of {old[0] * old_dp} sequences per global micro "
            f"batch ({was}), which set its epoch order; this run's {new[0] * new_dp} would reorder the epoch. Keep "
            f"train.micro_batch_size x data-parallel ranks = {old[0] * old_dp} and "
            f"train.grad_accum_steps={old[1]}.",
        )
    elif new_dp != old_dp and spec.parallel.comm_hook == "powersgd":
        yield SpecError(
            ("resume", "parallel.comm_hook", "launcher.nproc"),
            f"{newest} was written on {old_dp} data-parallel rank(s) and this run has {new_dp}: PowerSGD's error "
            "feedback is saved per rank and has no exact place on another count. Resume with "
            f"{num_ranks} rank(s), or with parallel.comm_hook=none (or fp16, bf16).",
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
