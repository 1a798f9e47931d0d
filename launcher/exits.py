"""The exit statuses of `train` and of every rank, in one table (the README documents the same)."""

from __future__ import annotations

from enum import IntEnum


class ExitStatus(IntEnum):
    """What a process's exit status says about the run."""

    OK = 0
    """The run (or the command) finished."""
    FAILED = 1
    """The run failed after it started; its completed checkpoints are intact."""
    INVALID_SPEC = 2
    """The spec or the command line is invalid; nothing was started and no run directory was made."""
    NONFINITE = 3
    """The run stopped on non-finite losses or gradients (train.on_nonfinite); the weights hold no NaN."""
    PREEMPTED = 4
    """A scheduler's signal stopped the run after a complete checkpoint; it resumes when requeued."""
    SUBMIT_FAILED = 5
    """The scheduler refused the batch job (e.g. sbatch: no such partition); nothing was started."""
    INTERRUPTED = 130
    """Stopped by SIGINT (Ctrl-C) after a complete checkpoint (128 + 2, the shell's convention)."""
    TERMINATED = 143
    """Stopped by SIGTERM after a complete checkpoint (128 + 15)."""


def for_signal(signum: int) -> ExitStatus:
    """The exit status of a run that a signal stopped gracefully: 130 for SIGINT, 143 for SIGTERM."""
    return ExitStatus.TERMINATED if signum == 15 else ExitStatus.INTERRUPTED
