"""The torchrun backend: an outer `torchrun ... -m launcher` started the ranks; this process is one of them.

`train` never chooses it: under torchrun every process composes the same spec, which records
torchrun's world (launcher.nproc, launcher.nnodes) and this backend, and runs its own rank here.
"""

from __future__ import annotations

from pathlib import Path

from launcher.components import collector
from launcher.spec import RunSpec


def describe(spec: RunSpec, run_dir: Path) -> str:
    """What `launch` does, for the dry run."""
    lc = spec.launcher
    return (
        f"torchrun: {lc.nnodes} node(s) x {lc.nproc} rank(s) started by torchrun, each running its rank in "
        f"its own process on {lc.device} device, reading {run_dir / 'spec.yaml'}"
    )


def launch(spec: RunSpec, run_dir: Path) -> int:
    """Run this process's rank; returns its exit status."""
    with collector.paused():  # the rank's imports and build; the loop collects at its own pauses
        from launcher.rank import worker

        with collector.frozen():  # the imports' objects: out of the passes until the rank ends
            return worker.run(run_dir / "spec.yaml")
