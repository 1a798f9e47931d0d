"""Graceful stops on a signal: a handler sets a flag, and every rank agrees to stop at the same step.

A scheduler warns a job before it ends it (SLURM's `--signal`, `scancel --signal`), and a person
presses Ctrl-C or sends SIGTERM. The rank's entry creates a `StopSignal` for the signals it
handles and hands it to the engine, which calls `agreed(dist)` once per optimizer step; when it
returns a signal, every rank stops after that same step, writes a complete checkpoint and ends
the run: "preempted" (exit status 4, requeued) for the scheduler's signal, "interrupted" for
SIGINT (130) or SIGTERM (143). A second SIGINT or SIGTERM stops the process at once. On a CPU
run the loop carries the flag in the next step's count of trained tokens, one collective for both
(launcher.rank.step_inputs). A `StopSignal()` without signals costs nothing and never communicates. The state lives in the
object, not in the module, and `close()` puts the previous handlers back.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed

    from launcher.parallel.dims import DistContext

INTERRUPT_SIGNALS = ("INT", "TERM")
"""What a person sends: finish the step, checkpoint, stop; a second one stops at once."""


def signal_number(name: str) -> signal.Signals:
    """The signal named USR2 or SIGUSR2."""
    return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]


class StopSignal:
    """Signals that ask the run to stop after the current step, on every rank together."""

    def __init__(self, signal_names: Iterable[str] = (), *, preemption: str | None = None) -> None:
        names = [*signal_names, *([preemption] if preemption else [])]
        self.preemption = signal_number(preemption) if preemption else None
        """The scheduler's warning signal: stopping on it means "preempted" (requeue), not "interrupted"."""
        self.received: signal.Signals | None = None
        """The first signal that arrived, if any."""
        self._previous: dict[signal.Signals, Any] = {}
        self._group: torch.distributed.ProcessGroup | None = None
        for name in dict.fromkeys(names):
            number = signal_number(name)
            try:
                self._previous[number] = signal.signal(number, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                break

    @property
    def numbers(self) -> tuple[signal.Signals, ...]:
        """The signals a handler is installed for."""
        return tuple(self._previous)

    @property
    def installed(self) -> bool:
        """Whether a handler is installed (without one, `agreed` never communicates)."""
        return bool(self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        number = signal.Signals(signum)
        if self.received is None or number == self.preemption:
            self.received = self.received or number
            return
        # A second interrupt: stop at once, as the signal would without a handler.
        signal.signal(number, signal.SIG_DFL)
        if number == signal.SIGINT:
            raise KeyboardInterrupt
        os.kill(os.getpid(), number)

    def close(self) -> None:
        """Put back the handlers that were installed before this object."""
        for number, previous in self._previous.items():
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def reason(self, number: int) -> str:
        """The exit reason of a stop on signal `number`: preempted (the scheduler's), else interrupted."""
        return "preempted" if number == self.preemption else "interrupted"

    def _control_group(self) -> torch.distributed.ProcessGroup | None:
        """A gloo group for the per-step flag: a CPU all-reduce never syncs a GPU stream."""
        import torch.distributed as tdist

        if tdist.get_backend() == "gloo":
            return None  # the default group
        if self._group is None:  # created collectively: every rank reaches its first check together
            self._group = tdist.new_group(backend="gloo")
        return self._group

    def agreed(self, dist: DistContext) -> int | None:
        """The signal number every rank stops on once any rank received one (one tiny CPU all-reduce per step)."""
        if not self.installed:
            return None
        own = int(self.received or 0)
        if dist.world_size > 1:
            import torch
            import torch.distributed as tdist

            flag = torch.tensor([own], dtype=torch.int32)
            tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=self._control_group())
            own = int(flag.item())
        return own or None
