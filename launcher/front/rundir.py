"""The one launch sequence of the launching process: validated spec -> run directory -> spec.yaml -> backend.

`train`, `verify_resume`, sweeps and the tests' helper all go through here, so a run directory is
always made the same way (private to the user), spec.yaml always written the same way (resolved,
secrets redacted), and problems always reported the same way (one paragraph each, exit status 2).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from omegaconf import DictConfig
from rich.console import Console

from launcher.config.redact import redacted_container
from launcher.exits import ExitStatus
from launcher.front import closing, compose, join
from launcher.front.config_values import with_values
from launcher.front.tokenize import prepare_data
from launcher.launch import backend, run_lock, submitter
from launcher.spec import InvalidSpec, RunSpec, SpecError, write_atomically

err_console = Console(stderr=True, highlight=False)


def report(errors: list[SpecError]) -> None:
    """Print every violation as one paragraph, naming keys and fixes."""
    count = f"{len(errors)} problem{'s' * (len(errors) > 1)}"
    err_console.print(f"[red bold]error:[/] the run spec is invalid ({count}); nothing was started.")
    for error in errors:
        err_console.print(f"  - {error}", markup=False, soft_wrap=True)


def safe_name(cfg: DictConfig) -> str:
    """The run name for a directory, unless it comes from the environment (it might be a secret)."""
    try:
        name = str(redacted_container(compose.strip_hydra(cfg)).get("name", "run"))
    except Exception:  # an interpolation that does not resolve: validation says why
        return "run"
    return "run" if "${" in name or not name.strip() else name


def default_run_dir(name: str, parent: Path = Path("runs")) -> Path:
    """parent/<name>-<timestamp>, with a -2, -3, ... suffix when that exists already."""
    base = parent / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def make_run_dir(path: Path) -> None:
    """Create the run directory private to the user (0700)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def write(built: compose.Built, run_dir: Path) -> RunSpec:
    """Make the run directory and write spec.yaml, the dump of the validated spec; the spec as the ranks will read it."""
    spec, text = built.written(run_dir)
    make_run_dir(run_dir)
    write_atomically(run_dir / "spec.yaml", text)
    return spec


def launch(spec: RunSpec, run_dir: Path, *, submit_only: bool = False) -> int:
    """Hand a written run to its launch backend; the run's exit status.

    `submit_only` (a sweep's points on a backend that submits): queue the job and return at once with
    the submission's status; the sweep collects the job later (launch.Submitter).
    """
    Console().print(f"run directory: {run_dir}")
    if submit_only:
        chosen = submitter(spec.launcher.backend)
        assert chosen is not None, f"{spec.launcher.backend} does not submit"
        return chosen.submit(spec, run_dir)
    return closing.announce(backend(spec.launcher.backend).launch(spec, run_dir), spec, run_dir)


def start(built: compose.Built, run_dir: Path, *, submit_only: bool = False) -> int:
    """Write the run directory of a validated spec and launch it, holding the directory's lock meanwhile.

    Another node of a multi-node local job neither writes nor locks: it joins node 0's run (front.join).
    `submit_only`: see `launch`.
    """
    spec = built.spec
    if spec.launcher.node_rank > 0:
        problem = join.wait_for_node_0(built, run_dir)
        if problem is not None:
            err_console.print(problem, markup=False, soft_wrap=True)
            return ExitStatus.FAILED
        return launch(dataclasses.replace(spec, run_dir=str(run_dir)), run_dir)
    try:
        make_run_dir(run_dir)
    except OSError as err:  # the rules found the parent writable; the filesystem said otherwise
        report(
            [
                SpecError(
                    ("run_dir",),
                    f"{run_dir} cannot be created ({err.strerror}). Give run_dir a path you can write.",
                )
            ]
        )
        return ExitStatus.INVALID_SPEC
    try:
        with run_lock.holding(run_dir):
            return launch(write(built, run_dir), run_dir, submit_only=submit_only)
    except run_lock.RunLockError as err:  # another run took the directory since the rules looked
        report([SpecError(("run_dir",), str(err))])
        return ExitStatus.INVALID_SPEC


def validate_and_start(cfg: DictConfig, run_dir: Path) -> int:
    """Validate a composed config, then write and launch it; exit status 2 (nothing started) when invalid."""
    built = compose.build(with_values(cfg, {"run_dir": str(run_dir)}))
    errors = list(built.errors) or prepare_data(built.spec)
    if errors:
        report(errors)
        return ExitStatus.INVALID_SPEC
    return start(built, run_dir)


def prepare(overrides: list[str], run_dir: Path) -> Path:
    """Compose, validate and write a run without launching it; the path of its spec.yaml.

    For callers that start the ranks themselves (e.g. under torchrun); raises InvalidSpec.
    """
    built = compose.build(compose.compose([*overrides, f"run_dir={run_dir}"]))
    if built.errors:
        raise InvalidSpec(list(built.errors))
    write(built, run_dir)
    return run_dir / "spec.yaml"
