"""Schema of run telemetry: the log schema, step timers, metrics.jsonl, summary.json, the progress bar.

What the group builds at run time lives in launcher.components.metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

PHASES = ("data", "forward", "backward", "optimizer")


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """What the run prints and records."""

    progress: bool = True
    """Show a live progress bar (loss, tokens/s, ETA) on rank 0; off a terminal, plain lines instead."""
    progress_every_s: float | None = 30.0
    """Off a terminal (piped, nohup): a plain progress line after this many seconds without output; null never."""
    verbose: bool = False
    """Show other libraries' chatter (load and save progress bars, notices) that the console filters out."""
    summary_table: bool = True
    """Print a table of the run's results at the end."""
