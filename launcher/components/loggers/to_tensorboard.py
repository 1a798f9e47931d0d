"""TensorBoard: scalars under RUN_DIR/logs/tensorboard, and the profiler's traces where its plugin looks.

A resumed session opens the same log directory with `purge_step` at its first step: TensorBoard
then drops the earlier session's events from that step on (the steps this session replays), so each
step is shown once, with the resumed session's values (those metrics.jsonl holds).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.components.loggers.records import scalars

if TYPE_CHECKING:
    from launcher.components.loggers.observers import RunContext
    from launcher.config.logger import TensorBoardConfig


def log_dir(run_dir: Path) -> Path:
    """Where the event files go: give it to `tensorboard --logdir`."""
    return run_dir / "logs" / "tensorboard"


class TensorBoardLogger:
    """Writes every metrics record as scalars, at the record's step."""

    def __init__(self, config: TensorBoardConfig, context: RunContext) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.run_dir, self.out = context.run_dir, log_dir(context.run_dir)
        earlier = self.out.is_dir() and any(self.out.glob("events.out.tfevents.*"))
        purge = context.start_step + 1 if earlier else None
        self.writer = SummaryWriter(log_dir=str(self.out), purge_step=purge)

    def on_record(self, record: dict[str, Any]) -> None:
        """One scalar per measured key (train/loss, eval/loss, perf/tokens_per_s, mem/peak_bytes, ...)."""
        step = int(record["step"])
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, global_step=step)

    def on_finish(self, summary: dict[str, Any]) -> None:
        """Flush; the summary itself is in summary.json."""
        self.writer.flush()

    def close(self) -> None:
        """Close the event file and link this run's profiler traces into the profile plugin's folder."""
        self.writer.close()
        link_traces(
            self.run_dir / "profile",
            self.out / "plugins" / "profile" / (self.run_dir.resolve().name or "run"),
        )


def link_traces(source: Path, target: Path) -> None:
    """Hard-link (or copy) the torch.profiler traces of `source` into `target`: TensorBoard's PyTorch
    profiler plugin reads `*.pt.trace.json` under the log directory, while RUN_DIR/profile keeps its own."""
    traces = sorted(source.glob("*.pt.trace.json")) if source.is_dir() else []
    for trace in traces:
        target.mkdir(parents=True, exist_ok=True)
        dest = target / trace.name
        if dest.exists():
            continue
        try:
            os.link(trace, dest)
        except OSError:
            with contextlib.suppress(OSError):
                shutil.copy2(trace, dest)
