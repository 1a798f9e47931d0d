"""Run telemetry: the log schema, step timers, metrics.jsonl, summary.json, the progress bar."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from launcher.config.log import PHASES


class PhaseTimer:
    """Accumulates time per loop phase without host syncs: CUDA events on GPU, a clock on CPU."""

    def __init__(self, device_type: str) -> None:
        self._cuda = device_type == "cuda"
        self._pending: list[tuple[str, Any, Any]] = []
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._open: tuple[str, Any] | None = None

    def _now(self) -> Any:
        if self._cuda:
            import torch  # torch only where a rank trains: the launching process never needs it

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, phase: str) -> None:
        """Begin timing `phase` (ends the phase in progress, if any)."""
        now = self._now()
        if self._open is not None:
            self._pending.append((self._open[0], self._open[1], now))
        self._open = (phase, now)

    def stop(self) -> None:
        """End the phase in progress."""
        if self._open is not None:
            self._pending.append((self._open[0], self._open[1], self._now()))
            self._open = None

    def read(self) -> dict[str, float]:
        """Seconds spent per phase since the last read (synchronizes CUDA: call on log steps only)."""
        if self._cuda and self._pending:
            self._pending[-1][2].synchronize()
        for phase, begin, end in self._pending:
            self._totals[phase] += begin.elapsed_time(end) / 1e3 if self._cuda else end - begin
        totals, self._totals, self._pending = self._totals, dict.fromkeys(PHASES, 0.0), []
        return totals


def peak_memory_bytes(device_type: str) -> int:
    """Peak memory of this rank: allocated CUDA memory on GPU, resident set size on CPU."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MetricsFile:
    """Appends one JSON object per logged step to metrics.jsonl (line-buffered, crash-safe)."""

    def __init__(self, path: Path) -> None:
        self._handle = open(path, "a", buffering=1)  # noqa: SIM115 - held open for the whole run

    def write(self, record: dict[str, Any]) -> None:
        """Append one record."""
        self._handle.write(json.dumps(record) + "\n")

    def close(self) -> None:
        """Close the file."""
        self._handle.close()


def truncate_after(path: Path, step: int) -> int:
    """Remove the records of steps after `step` (atomically); how many were removed."""
    if not Path(path).is_file():
        return 0
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    if len(kept) == len(lines):
        return 0
    tmp = Path(path).with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)
    return len(lines) - len(kept)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """Write summary.json atomically."""
    tmp = Path(run_dir) / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(Path(run_dir) / "summary.json")


def make_progress(console: Console, total: int, completed: int) -> tuple[Progress, Any]:
    """A rich progress bar with loss, tokens/s and ETA, and its task id."""
    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss [cyan]{task.fields[loss]}"),
        TextColumn("[green]{task.fields[tps]}[/] tok/s"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
    task = progress.add_task("train", total=total, completed=completed, loss="-", tps="-")
    return progress, task


class ProgressLines:
    """A plain progress line when nothing was printed for `every_s` seconds, where no progress bar draws.

    Off a terminal (CI, nohup, `| tee`) rich's bar draws nothing and the log lines come only every
    train.log_every steps, which can be minutes apart: this line says where the run is (steps, the
    last logged loss and rate, as the bar shows them, and the time left at this session's pace).
    """

    def __init__(self, console: Console, *, total: int, start_step: int, every_s: float) -> None:
        self._console, self._total, self._every_s = console, total, every_s
        self._start = (time.perf_counter(), start_step)
        self._printed = self._start[0]
        self._last: dict[str, Any] = {}

    def after_step(self, step: int, records: list[dict[str, Any]]) -> None:
        """After `step`: note a training record (its log line was just printed), else print if it is time."""
        now = time.perf_counter()
        logged = [r for r in records if "loss" in r]
        if logged:
            self._last, self._printed = logged[-1], now
        elif now - self._printed >= self._every_s:
            self._console.print(self.line(step, now), markup=False, highlight=False)
            self._console.file.flush()  # a pipe is block-buffered: the line is for now
            self._printed = now

    def line(self, step: int, now: float) -> str:
        """`progress: step S/N (P%), loss L, R tok/s, eta H:MM:SS` (loss and rate once a step was logged)."""
        parts = [f"progress: step {step}/{self._total} ({100 * step // max(self._total, 1)}%)"]
        if self._last:
            parts += [f"loss {self._last['loss']:.4f}", f"{self._last['tokens_per_s']:,.0f} tok/s"]
        began, first = self._start
        if step > first:
            left = (self._total - step) * (now - began) / (step - first)
            parts.append(f"eta {int(left) // 3600}:{int(left) // 60 % 60:02d}:{int(left) % 60:02d}")
        return ", ".join(parts)


def summary_table(summary: dict[str, Any]) -> Table:
    """The end-of-run table printed on rank 0."""
    table = Table(title="run summary", show_header=False)
    for key, value in summary.items():
        for name, item in value.items() if isinstance(value, dict) else [("", value)]:  # best_checkpoint, ...
            table.add_row(
                f"{key}.{name}" if name else key, f"{item:.4g}" if isinstance(item, float) else str(item)
            )
    return table
