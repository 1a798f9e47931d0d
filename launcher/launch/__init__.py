"""Where a run goes: the Backend protocol and the registry of launch backends (inline, local, slurm).

A backend turns a written run directory (its spec.yaml) into running ranks: `describe` says what
`launch` would do (the dry run prints it; a test can read it without starting anything), `launch`
does it and returns the run's exit status. How ranks start inside a backend is torch's elastic
launcher (local) or srun (slurm); every rank then runs launcher.rank.worker on spec.yaml.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    from launcher.spec import RunSpec

BACKENDS: dict[str, str] = {
    "inline": "launcher.launch.inline",
    "local": "launcher.launch.local",
    "slurm": "launcher.launch.slurm",
    "torchrun": "launcher.launch.torchrun",
}
"""Backend name -> the module implementing it, imported when chosen."""


class Backend(Protocol):
    """What each backend module offers."""

    def describe(self, spec: RunSpec, run_dir: Path) -> str:
        """What `launch` would do, for the dry run."""
        ...

    def launch(self, spec: RunSpec, run_dir: Path) -> int:
        """Start the ranks of the run written in `run_dir` and wait for them; the exit status."""
        ...


def backend(name: str) -> Backend:
    """The backend module registered under `name`, imported on demand."""
    return cast(Backend, importlib.import_module(BACKENDS[name]))
