"""The inline backend: world size 1, in this very process (the fast path without GPUs)."""

from __future__ import annotations

from pathlib import Path

from launcher.components import collector
from launcher.spec import RunSpec


def describe(spec: RunSpec, run_dir: Path) -> str:
    """What `launch` would do, for the dry run."""
    return f"inline: 1 rank in this process on {spec.launcher.device} device, reading {run_dir / 'spec.yaml'}"


def launch(spec: RunSpec, run_dir: Path) -> int:
    """Run the single rank here; returns its exit status."""
    with collector.paused():  # the rank's imports and build; the loop collects at its own pauses
        from launcher.rank import worker

        with collector.frozen():  # the imports' objects: out of the passes until the rank ends
            return worker.run(run_dir / "spec.yaml")
