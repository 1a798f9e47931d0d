"""The non-finite guard's bookkeeping: skipped steps counted without host syncs, and the stop policy.

The strategies leave the weights untouched on a step whose loss or gradients are not finite and
report it in their StepResult, as a device flag where they can (fused optimizers). The flags add up
on the device and are read on log steps only (`settle`); a flag already on the host acts at once.
The run stops (exit status 3, NonFiniteStop) when train.on_nonfinite=stop, when more than
train.max_nonfinite_skips steps were skipped in all, or when more than train.max_nonfinite_fraction
of the last train.nonfinite_window_steps steps were skipped (a run that has gone bad, not a spike).
A non-finite learning rate or fp16 loss scale stops it too, before the weights are touched.
"""

from __future__ import annotations

import math
from collections import deque

import torch
from rich.console import Console

from launcher.parallel.strategy import StepResult
from launcher.spec import TrainConfig

ADVICE = (
    "The weights hold no NaN; lower optimizer.lr (or use precision=bf16 instead of fp16), check the "
    "data, then continue from the last checkpoint with resume=auto."
)


class NonFiniteStop(RuntimeError):
    """The run stopped on non-finite losses, gradients, learning rate or loss scale (exit status 3)."""


class NonFiniteGuard:
    """Counts skipped steps (non-finite and fp16 overflow) and applies the stop policy."""

    def __init__(self, train: TrainConfig, device: torch.device, console: Console, *, is_main: bool) -> None:
        self.train, self.device, self.console, self.is_main = train, device, console, is_main
        self.nonfinite_skips = 0
        """Non-finite steps skipped so far in the whole run."""
        self.overflow_skips = 0
        """fp16 steps the loss scaler skipped so far."""
        self._pending = self._zeros()
        self._recent: deque[tuple[int, int]] = deque()  # (step settled at, steps skipped in that interval)
        self._session_start = 0

    def _zeros(self) -> dict[str, torch.Tensor]:
        return {k: torch.zeros((), dtype=torch.int64, device=self.device) for k in ("nonfinite", "overflow")}

    def start_session(self, step: int) -> None:
        """The step this session begins at (the fraction window needs that many steps of its own)."""
        self._session_start = step

    def record(self, result: StepResult, step: int) -> None:
        """Add one optimizer step's flags; a non-finite step known on the host settles at once."""
        self._pending["nonfinite"] += result.nonfinite
        self._pending["overflow"] += result.overflow
        if result.nonfinite is True:
            self.settle(step)

    def settle(self, step: int) -> None:
        """Read the pending flags (a device read: log steps and saves only) and apply the policy."""
        t = self.train
        nonfinite, overflow = (int(v) for v in self._pending.values())
        self._pending = self._zeros()
        self.overflow_skips += overflow
        self._recent.append((step, nonfinite))
        while self._recent and self._recent[0][0] <= step - t.nonfinite_window_steps:
            self._recent.popleft()
        if not nonfinite:
            return
        self.nonfinite_skips += nonfinite
        if self.is_main:
            self.console.print(f"[yellow]up to step {step}: {nonfinite} non-finite step(s) skipped")
        recent = sum(count for _, count in self._recent)
        window_full = step - self._session_start >= t.nonfinite_window_steps
        if t.on_nonfinite == "stop" or self.nonfinite_skips > t.max_nonfinite_skips:
            raise NonFiniteStop(
                f"stopped at step {step} after {self.nonfinite_skips} non-finite step(s) "
                f"(train.on_nonfinite={t.on_nonfinite}, train.max_nonfinite_skips={t.max_nonfinite_skips}). {ADVICE}"
            )
        if window_full and recent > t.max_nonfinite_fraction * t.nonfinite_window_steps:
            raise NonFiniteStop(
                f"stopped at step {step}: {recent} of the last {t.nonfinite_window_steps} steps were skipped as "
                f"non-finite, more than train.max_nonfinite_fraction={t.max_nonfinite_fraction:g}: the run "
                f"is not training any more. {ADVICE}"
            )

    def check_learning_rate(self, lr: float, step: int) -> None:
        """Stop before a step whose learning rate is not finite (a host value: no sync)."""
        if not math.isfinite(lr):
            raise NonFiniteStop(
                f"the learning rate is {lr} at step {step + 1}; nothing was updated with it. {ADVICE}"
            )

    def check_loss_scale(self, scale: float | None, step: int) -> None:
        """Stop when the fp16 loss scale itself is no longer finite (read on log steps)."""
        if scale is not None and not math.isfinite(scale):
            raise NonFiniteStop(f"the fp16 loss scale is {scale} at step {step}. {ADVICE}")

    def check_final_loss(self, loss: float | None, step: int) -> None:
        """A run never ends "completed" with a non-finite final loss."""
        if loss is not None and not math.isfinite(loss):
            raise NonFiniteStop(f"the run reached step {step} but its final loss is {loss}. {ADVICE}")

    def state_dict(self) -> dict[str, int]:
        """The counters a checkpoint keeps."""
        return {"nonfinite_skips": self.nonfinite_skips, "overflow_skips": self.overflow_skips}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the counters of a checkpoint."""
        self.nonfinite_skips = state["nonfinite_skips"]
        self.overflow_skips = state["overflow_skips"]
