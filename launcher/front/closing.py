"""What the launching process says when a run ends: where its files are and how to continue it.

The run's own console output scrolls away; these few lines, printed last, name the run directory,
the exact command that resumes it (spec.yaml alone reproduces a run, and resume=auto continues from
its newest complete checkpoint) and the files a user looks at next.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from launcher.launch import returns_at_once
from launcher.spec import RunSpec


def closing_lines(run_dir: Path, status: int) -> list[str]:
    """The lines printed after a run ended with `status`: the run directory, the resume command, its files."""
    lines = [
        f"run directory: {run_dir} (exit status {status})",
        f"resume: train --config-path {run_dir.resolve()} --config-name spec resume=auto"
        " (add train.max_steps=N to train further)",
    ]
    for name, what in (("metrics.jsonl", "metrics"), ("summary.json", "summary")):
        if (run_dir / name).is_file():
            lines.append(f"{what}: {run_dir / name}")
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        latest = checkpoints / "latest"
        newest = latest.read_text().strip() if latest.is_file() else "none complete"
        lines.append(f"checkpoints: {checkpoints} (latest: {newest})")
    logs = run_dir / "logs"
    if logs.is_dir() and any(logs.iterdir()):
        lines.append(f"logs: {', '.join(str(entry) for entry in sorted(logs.iterdir()))}")
    return lines


def announce(status: int, spec: RunSpec, run_dir: Path) -> int:
    """Print the closing lines of a run that ended here (not of a batch job left to run); the status."""
    if returns_at_once(spec):
        return status  # submitted only: the backend said where the job's files will be
    console = Console(highlight=False, soft_wrap=True)
    for line in closing_lines(run_dir, status):
        console.print(line, markup=False)
    return status
