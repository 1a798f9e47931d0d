"""A rank's entry point: read spec.yaml, join the job, build, resume if asked, run the loop."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as torch_dist
from rich.console import Console
from rich.markup import escape
from torch.distributed.checkpoint.api import CheckpointException

from launcher.components import (
    checkpoint,
    checkpoint_aside,
    checkpoint_files,
    collector,
    metrics,
    quiet,
    warning_lines,
)
from launcher.components.device import resolve_device
from launcher.components.files.safe_load import RefusedFile, refusal_in
from launcher.components.memory import apply_cuda_alloc_conf
from launcher.components.rewards import RewardError, stop_message
from launcher.exits import ExitStatus, for_signal
from launcher.parallel.deepspeed import accelerator_env
from launcher.parallel.dims import DistContext, shutdown
from launcher.parallel.registry import STRATEGIES
from launcher.rank import preflight
from launcher.rank.build import build
from launcher.rank.engine import Engine
from launcher.rank.nonfinite import NonFiniteStop
from launcher.rank.preemption import INTERRUPT_SIGNALS, StopSignal
from launcher.spec import RunSpec, load_spec


def restarted_here() -> bool:
    """Whether this process belongs to a restarted job: an elastic restart, or a SLURM requeue."""
    return any(
        int(os.environ.get(var, "0") or 0) > 0
        for var in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
    )


def restarted_anywhere(ctx: DistContext) -> bool:
    """Whether any rank's job was restarted: across nodes, torch's agent counts a restart only on the node
    that failed (the others restart for the new round without counting), so the ranks agree (a max)."""
    flag = int(restarted_here())
    if ctx.world_size > 1 and torch_dist.is_initialized():
        tensor = torch.tensor([flag], device=ctx.device)
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
        flag = int(tensor.item())
    return bool(flag)


def resume_candidates(spec: RunSpec, run_dir: Path, *, restarted: bool | None = None) -> list[Path]:
    """Checkpoints to try, newest first: what `resume` names, or this run's own after a restart."""
    restarted = restarted_here() if restarted is None else restarted
    resume = "auto" if restarted and spec.resume is None else spec.resume
    if resume is None:
        return []
    return checkpoint.resolve_resume(resume, run_dir)


class ResumeError(RuntimeError):
    """Checkpoints exist but none verifies and loads; the run does not start over silently."""


def restore_newest(engine: Engine, candidates: list[Path], console: Console, *, verify: bool) -> None:
    """Load the newest checkpoint that verifies and loads, the same one on every rank.

    Every rank loads each candidate while rank 0 re-reads its files beside the load and compares them
    with their digests (checkpoint.verify; what a checkpoint that differs loaded is thrown away when
    the next one loads); a checkpoint that differs, does not load or holds non-finite weights is named in a warning and
    the next older one is tried; one of this run whose files differ is moved to checkpoints/damaged/.
    A file that names code (launcher.components.files.safe_load), whether its digest matches or not,
    stops every rank instead and stays where it is. Every
    decision is agreed by all ranks. This starts the session pruning reads.
    """
    dist = engine.parts.dist
    checkpoint.start_session(engine.run_dir)
    unloadable: dict[Path, str] = {}  # verified but did not load: damaged once an older one loads
    for path in candidates:
        reason, error = checkpoint_files.verify_while(
            path,
            functools.partial(engine.restore, path),
            verify=verify and dist.is_main,
            errors=(Exception, CheckpointException),  # CheckpointException: DCP gathers ranks' failures
        )
        verified = dist.all_true(reason is None)
        if verified:  # the files are the ones written: what the load made of them counts
            refused = refusal_in(error) if error is not None else None
            if error is not None:  # e.g. a file that passes the checks but does not unpickle
                reason = f"it does not load ({type(error).__name__}: {refused or error})"
            _stop_at_code(dist, path, refused)
            if not engine.weights_finite():
                reason = reason or "its weights hold NaN or inf"
            if dist.all_true(reason is None):
                checkpoint.resumed(engine.run_dir, path, verified=verify)
                if dist.is_main:
                    console.print(f"resumed from {path} at step {engine.step}")
                    _drop_replayed_metrics(engine)
                    notice(
                        console,
                        engine.spec,
                        checkpoint_aside.damaged_after_resume(engine.run_dir, unloadable),
                    )
                    notice(console, engine.spec, checkpoint_aside.abandon_branches(engine.run_dir, path))
                return
        else:  # its files differ from their digests: damaged, unless a changed file names code (evidence)
            _stop_at_code(dist, path, checkpoint_aside.code_in(path) if dist.is_main else None)
            if dist.is_main and checkpoint.is_own(engine.run_dir, path):
                reason = f"{reason}; moved aside to {checkpoint.set_aside(engine.run_dir, path)}"
        found = _skipped(engine, console, path, reason)
        if verified and found is not None:
            unloadable[path] = found
    if candidates:
        raise ResumeError(
            f"none of the {len(candidates)} checkpoint(s) to resume from verifies and loads "
            f"({', '.join(p.name for p in candidates)}; the warnings above say why). Resume from another run "
            "directory or checkpoint (resume=PATH), or start a new run (another run_dir)."
        )
    if set_aside := checkpoint.damaged(engine.run_dir):  # an earlier session found them all damaged
        raise ResumeError(
            f"no checkpoint of {engine.run_dir} verifies: {', '.join(p.name for p in set_aside)} in "
            f"{set_aside[0].parent} were found damaged, and the run does not start over on its own. Resume "
            "from another run directory or checkpoint (resume=PATH), or start a new run (another run_dir)."
        )


def notice(console: Console, spec: RunSpec, lines: list[str]) -> None:
    """Rank 0: each line as a warning on the main console (a warning on stderr inline; rank 0's stdout, which
    the local and SLURM backends show, otherwise)."""
    for line in lines:
        if spec.launcher.backend == "inline":
            warnings.warn(line, stacklevel=2)
        else:
            console.print(f"warning: {line}", markup=False)


class _ConsoleLines(logging.Handler):
    """checkpoint.LOG's lines (a checkpoint removed or moved aside while saving) as warnings on rank 0's console."""

    def __init__(self, console: Console) -> None:
        super().__init__(logging.WARNING)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        self.console.print(f"warning: {record.getMessage()}", markup=False)


def _skipped(engine: Engine, console: Console, path: Path, reason: str | None) -> str | None:
    """Every rank: why `path` is skipped, as the first rank that found a reason says it, named on rank 0's console
    (and on the rank's own log); that reason."""
    dist = engine.parts.dist
    reasons = [reason]
    if dist.world_size > 1:
        reasons = [None] * dist.world_size
        torch_dist.all_gather_object(reasons, reason)
    rank = next((r for r, text in enumerate(reasons) if text is not None), None)
    if rank is None:
        return None
    found = reasons[rank] if rank == 0 else f"{reasons[rank]} (on rank {rank})"
    if dist.is_main:
        notice(console, engine.spec, [f"skipping checkpoint {path}: {found}"])
    elif reason is not None:
        warnings.warn(f"skipping checkpoint {path}: {reason}", stacklevel=2)  # this rank's log
    return found


def _stop_at_code(dist: DistContext, path: Path, refused: RefusedFile | None) -> None:
    """Every rank stops (ResumeError) when any rank was refused a file of `path` that names code.

    Such a file was changed after it was written, which is not damage: resuming from an older
    checkpoint instead would hide it, so the run stops and says which file (on the rank that read it).
    """
    names_code = refused is not None and refused.names_code
    if dist.all_true(not names_code):
        return
    if names_code:
        raise ResumeError(str(refused))
    raise ResumeError(
        f"another rank was refused a file of {path} that names code (its error names the file)."
    )


def _drop_replayed_metrics(engine: Engine) -> None:
    """Remove metrics records of steps after the checkpoint: the resumed session logs them again."""
    dropped = metrics.truncate_after(engine.run_dir / "metrics.jsonl", engine.step)
    if dropped:
        engine.console.print(
            f"metrics.jsonl: {dropped} record(s) after step {engine.step} from the previous session removed "
            "(this session logs those steps again)"
        )


def clear_unfinished(run_dir: Path, console: Console) -> None:
    """Report and remove partial checkpoint directories that a save which did not finish left behind."""
    for path in checkpoint.unfinished(run_dir):
        console.print(f"[yellow]warning:[/] removed {path}: a checkpoint save there did not finish")
        shutil.rmtree(path, ignore_errors=True)


def tidy_checkpoints(dist: DistContext, spec: RunSpec, run_dir: Path, console: Console) -> None:
    """Before a session resumes: rank 0 removes unfinished saves and moves incomplete checkpoints and paths in the
    way to damaged/ (a line each); every rank stops instead when one of those files names code (it stays put)."""
    refused = None
    if dist.is_main:
        clear_unfinished(run_dir, console)
        refused = checkpoint_aside.code_in_incomplete(run_dir)
        notice(console, spec, checkpoint_aside.tidy(run_dir) if refused is None else [])
    _stop_at_code(dist, checkpoint.root(run_dir), refused)


def configure_process(spec: RunSpec, device_type: str) -> None:
    """Set the process-wide switches libraries read at import, before any of them is imported.

    The rank's entry owns its process environment; nothing deeper changes it. DeepSpeed picks its
    accelerator from DS_ACCELERATOR when it is first imported, and reads LOCAL_RANK even in a
    one-process job.
    """
    if (
        STRATEGIES[spec.parallel.strategy].wrap == "engine"
    ):  # DeepSpeed, which reads its accelerator at import
        os.environ.update(accelerator_env(device_type))
    if "WORLD_SIZE" not in os.environ:  # a single process (inline): the variables torchrun would set
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    if device_type == "cuda" and spec.memory.cuda_alloc_conf is not None:
        apply_cuda_alloc_conf(spec.memory.cuda_alloc_conf)


def exit_status(summary: dict) -> ExitStatus:
    """The process's exit status for a run that ended as `summary` says."""
    if summary["exit_reason"] == "preempted":
        return ExitStatus.PREEMPTED
    if summary["exit_reason"] == "interrupted":
        return for_signal(int(signal.Signals[summary["signal"]]))
    return ExitStatus.OK


def run(spec_path: Path, *, preemption: str | None = None) -> int:
    """Run this rank of the job described by `spec_path`; returns the process exit status.

    SIGINT and SIGTERM stop the run after the current step with a checkpoint (130, 143; a second
    one stops at once); `preemption` names a scheduler's warning signal too (SLURM: exit status 4).
    """
    stop = StopSignal(INTERRUPT_SIGNALS, preemption=preemption)
    try:
        return _run(spec_path, stop)
    finally:
        stop.close()


def _run(spec_path: Path, stop: StopSignal) -> int:
    spec = load_spec(spec_path)
    run_dir = Path(spec.run_dir or spec_path.parent)
    console = Console(stderr=False, soft_wrap=True)  # log lines are not cut at 80 columns in files
    device_type = resolve_device(spec.launcher.device)
    configure_process(spec, device_type)
    dist = preflight.join(
        device_type,
        spec.launcher.timeout_s,
        parallel=spec.parallel,
        one_rank_group=STRATEGIES[spec.parallel.strategy].process_group,
    )
    started = time.perf_counter()
    engine, at_once, summary = None, False, None
    lines = _ConsoleLines(console) if dist.is_main and spec.launcher.backend != "inline" else None
    if lines is not None:  # inline, stderr is the console already
        checkpoint.LOG.addHandler(lines)
    try:
        engine = Engine(build(spec, dist, run_dir), run_dir, console, stop=stop)
        tidy_checkpoints(dist, spec, run_dir, console)
        candidates = resume_candidates(spec, run_dir, restarted=restarted_anywhere(dist))
        restore_newest(engine, candidates, console, verify=spec.checkpoint.verify)
        summary = engine.run()
        code = exit_status(summary)
    except NonFiniteStop as err:
        console.print("[red]error:[/]", escape(str(err)))
        try:
            engine.finish_saves()  # every rank stops at the same step: the save in flight is committed
        except checkpoint.CheckpointSaveError as failed:
            console.print("[red]error:[/]", escape(str(failed)))
        summary, code = engine.summary("nonfinite", time.perf_counter() - started), ExitStatus.NONFINITE
    except checkpoint.CheckpointSaveError as err:  # its text holds paths: printed as it is, not as markup
        console.print("[red]error:[/]", escape(str(err)))
        summary, code = engine.summary("checkpoint_failed", time.perf_counter() - started), ExitStatus.FAILED
    except ResumeError as err:
        console.print(f"error: {err}", markup=False)
        summary, code = engine.summary("resume_failed", time.perf_counter() - started), ExitStatus.FAILED
    except (
        RewardError
    ) as err:  # online RL: a reward raised or returned a bad value (launcher.rank.rollout_scoring)
        engine.finish_saves()  # every rank stops at the same step: the save in flight is committed
        newest = next(iter(checkpoint.good_checkpoints(run_dir, warn=False)), None)
        console.print(f"error: {stop_message(err, engine.step + 1, newest)}", markup=False)
        summary, code = engine.summary("reward_failed", time.perf_counter() - started), ExitStatus.FAILED
    except RefusedFile as err:  # while building: a teacher's or a model folder's file that is not plain data
        console.print(f"error: {err}", markup=False)
        code = ExitStatus.FAILED
    except KeyboardInterrupt:  # a second Ctrl-C: stop at once, meeting no other rank
        at_once = True
        raise
    finally:
        if lines is not None:
            checkpoint.LOG.removeHandler(lines)
        if engine is not None:
            if engine.saver is not None and not at_once:  # a failed run's write ends, uncommitted
                engine.saver.close()
            if summary is not None:
                engine.observers.finish(summary)  # observers may add to it (advice), then close
            engine.observers.close()  # idempotent; all that is left after a crash
        del engine
        shutdown(barrier=not at_once)
    if dist.is_main and summary is not None:
        metrics.write_summary(run_dir, summary)
        if spec.log.summary_table:
            console.print(metrics.summary_table(summary))
    return int(code)


def run_process(spec_path: Path, *, preemption: str | None = None) -> int:
    """`run` in a process of its own (a rank a backend started): its warnings as one line each, once, and other
    libraries' chatter off unless log.verbose (launcher.components.quiet).

    In-process callers (`train`'s inline backend, which installed the same display already, and
    tests recording warnings) call `run`, which leaves Python's warning display as it is.
    Its imports are frozen out of the collector's passes for the run, and everything it holds at its
    end out of the interpreter's last collections (launcher.components.collector): those walked some
    half a million objects for about a second of CPU per rank before the process could exit.
    """
    warning_lines.install()
    quiet.install(verbose=load_spec(spec_path).log.verbose)
    try:
        with collector.frozen():  # the imports' objects: the loop's first collection walks only the build's
            return run(spec_path, preemption=preemption)
    finally:
        collector.freeze_for_exit()


def main() -> None:
    """`python -m launcher.rank.worker SPEC_YAML`: how launch backends start a rank."""
    collector.pause()  # the build, as a rank in the launching process builds; the loop collects at its pauses
    sys.exit(run_process(Path(sys.argv[1])))


if __name__ == "__main__":
    main()
