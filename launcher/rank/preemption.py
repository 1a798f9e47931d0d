"""Graceful stops on a signal: a handler sets a flag, and every rank agrees to stop at the same step.

A scheduler (SLURM's `--signal`, or `scancel --signal`) warns a job before it ends it. The rank's
entry (launcher.launch.slurm_rank) creates a `StopSignal` for that signal and hands it to the
engine, which calls `agreed(dist)` once per optimizer step, writes a complete checkpoint when it
returns True and ends the run with exit status 4 (ExitStatus.PREEMPTED). A `StopSignal()` without a
signal costs nothing and never communicates. The state lives in the object, not in the module.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed

    from launcher.parallel.dims import DistContext


def signal_number(name: str) -> signal.Signals:
    """The signal named USR2 or SIGUSR2."""
    return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]


class StopSignal:
    """A signal that asks the run to stop after the current step, on every rank together."""

    def __init__(self, signal_name: str | None = None) -> None:
        self.installed = signal_name is not None
        """Whether a handler is installed (without one, `agreed` never communicates)."""
        self.received: str | None = None
        """The name of the signal that arrived, if any."""
        self._group: torch.distributed.ProcessGroup | None = None
        if signal_name is not None:
            signal.signal(signal_number(signal_name), self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        """Whether this process has received the signal."""
        return self.received is not None

    def _control_group(self) -> torch.distributed.ProcessGroup | None:
        """A gloo group for the per-step flag: a CPU all-reduce never syncs a GPU stream."""
        import torch.distributed as tdist

        if tdist.get_backend() == "gloo":
            return None  # the default group
        if self._group is None:  # created collectively: every rank reaches its first check together
            self._group = tdist.new_group(backend="gloo")
        return self._group

    def agreed(self, dist: DistContext) -> bool:
        """True on every rank once any rank received the signal (one tiny CPU all-reduce per step)."""
        if not self.installed:
            return False
        if dist.world_size == 1:
            return self.requested
        import torch
        import torch.distributed as tdist

        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32)
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=self._control_group())
        return bool(flag.item())
