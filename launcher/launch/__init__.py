"""Where a run goes: the Backend protocols and the registry of launch backends (inline, local, slurm).

A backend turns a written run directory (its spec.yaml) into running ranks: `describe` says what
`launch` would do (the dry run prints it; a test can read it without starting anything), `launch`
does it and returns the run's exit status. How ranks start inside a backend is torch's elastic
launcher (local) or srun (slurm); every rank then runs launcher.rank.worker on spec.yaml.

A backend that hands the run to a scheduler (slurm) is also a `Submitter`: `submit` returns as soon
as the job is queued, leaving what identifies it in the run directory; `status` reads that back and
asks the scheduler; `collect` waits for the job's end. Sweeps, `train-sweep-status` and the closing
lines use only these verbs (through `submitter` and `job_state`), never a backend's name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
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


@dataclass(frozen=True, kw_only=True)
class JobState:
    """A submitted run's job as its backend reports it: all a sweep or its table needs to know."""

    job_id: str
    """The backend's id of the job (what its own tools take, e.g. `squeue -j`)."""
    state: str | None
    """The backend's name of the state, e.g. PENDING, RUNNING, COMPLETED, FAILED; None: the scheduler no longer
    knows the job, or does not answer."""
    active: bool
    """Queued or running: the job may still change (requeues included)."""
    exit_code: int
    """The job's exit status once it ended (0 while it is active or unknown)."""


class Backend(Protocol):
    """What each backend module offers."""

    def describe(self, spec: RunSpec, run_dir: Path) -> str:
        """What `launch` would do, for the dry run."""
        ...

    def launch(self, spec: RunSpec, run_dir: Path) -> int:
        """Start the ranks of the run written in `run_dir` and wait for them; the exit status."""
        ...


class Submitter(Backend, Protocol):
    """A backend that submits a run to a scheduler and can return before the run ends."""

    WAIT_KEY: str
    """The config key behind `waits` (a sweep collects its jobs itself, so a re-run may change it)."""

    def submit(self, spec: RunSpec, run_dir: Path) -> int:
        """Queue the run and return at once: 0, the job's id left in `run_dir`; else SUBMIT_FAILED, the reason printed."""
        ...

    def status(self, run_dir: Path) -> JobState | None:
        """The job `submit` left in `run_dir` and its state as the scheduler says it; None when none was submitted."""
        ...

    def collect(self, run_dir: Path) -> int:
        """Wait until the job `submit` left in `run_dir` has ended (through requeues); the run's exit status."""
        ...

    def waits(self, spec: RunSpec) -> bool:
        """Whether `launch` waits for the job's end (else it returns once the job is queued)."""
        ...


SUBMITTER_NAMES = ("submit", "status", "collect", "waits", "WAIT_KEY")
"""What a backend module defines to be a Submitter."""


def backend(name: str) -> Backend:
    """The backend module registered under `name`, imported on demand."""
    return cast(Backend, importlib.import_module(BACKENDS[name]))


def submitter(name: str) -> Submitter | None:
    """The backend registered under `name` if it submits to a scheduler (all of SUBMITTER_NAMES), else None."""
    module = backend(name)
    return cast(Submitter, module) if all(hasattr(module, part) for part in SUBMITTER_NAMES) else None


def returns_at_once(spec: RunSpec) -> bool:
    """The spec's backend queues the run and returns without waiting for it (the job's files come later)."""
    chosen = submitter(spec.launcher.backend)
    return chosen is not None and not chosen.waits(spec)


def _backend_of(run_dir: Path) -> str | None:
    """launcher.backend as the run's spec.yaml records it; None without a readable one."""
    import yaml

    try:
        data = yaml.safe_load((Path(run_dir) / "spec.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    launcher = data.get("launcher") if isinstance(data, dict) else None
    name = launcher.get("backend") if isinstance(launcher, dict) else None
    return name if isinstance(name, str) and name in BACKENDS else None


def job_state(run_dir: Path) -> JobState | None:
    """The job the run in `run_dir` was submitted as, asked of its backend; None when it was not submitted."""
    name = _backend_of(run_dir)
    chosen = submitter(name) if name is not None else None
    return chosen.status(run_dir) if chosen is not None else None
