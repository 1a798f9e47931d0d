"""Graceful stops on a signal: a handler sets a flag, and every rank agrees to stop at the same step.

A scheduler (SLURM's `--signal`, or `scancel --signal`) warns a job before it ends it. The launch
backend installs `install(signal)` in each rank; the engine calls `stop_agreed(dist)` once per
optimizer step, writes a complete checkpoint when it returns True and ends the run with exit
status EXIT_PREEMPTED. Without an installed handler the check costs nothing and never communicates.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.parallel.dims import DistContext

EXIT_PREEMPTED = 4
"""Process exit status of a run stopped by a preemption signal after writing its checkpoint."""

_state: dict[str, object] = {"installed": False, "requested": False, "signal": None, "group": None}


def _handle(signum: int, frame: FrameType | None) -> None:
    _state["requested"] = True
    _state["signal"] = signal.Signals(signum).name


def install(signal_name: str) -> None:
    """Catch `signal_name` (e.g. USR2 or SIGUSR2) in this process and remember that it arrived."""
    name = signal_name if signal_name.startswith("SIG") else f"SIG{signal_name}"
    signal.signal(signal.Signals[name], _handle)
    _state["installed"] = True


def installed() -> bool:
    """Whether a preemption handler is active in this process."""
    return bool(_state["installed"])


def requested() -> bool:
    """Whether this process has received the preemption signal."""
    return bool(_state["requested"])


def received_signal() -> str | None:
    """The name of the signal that asked for the stop, if any."""
    return _state["signal"]  # type: ignore[return-value]


def reset() -> None:
    """Forget a received signal and uninstall nothing (for a process that runs several jobs)."""
    _state["requested"] = False
    _state["signal"] = None
    _state["group"] = None


def _control_group() -> object | None:
    """A gloo group for the per-step flag: a CPU all-reduce never syncs a GPU stream."""
    import torch.distributed as tdist

    if tdist.get_backend() == "gloo":
        return None  # the default group
    if _state["group"] is None:  # created collectively: every rank reaches its first check together
        _state["group"] = tdist.new_group(backend="gloo")
    return _state["group"]


def stop_agreed(dist: DistContext) -> bool:
    """True on every rank once any rank received the signal (one tiny CPU all-reduce per step)."""
    if not installed():
        return False
    if dist.world_size == 1:
        return requested()
    import torch
    import torch.distributed as tdist

    flag = torch.tensor([1 if requested() else 0], dtype=torch.int32)
    tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=_control_group())
    return bool(flag.item())
