"""docs/architecture.md's recipe "A backend", followed on a copy of the package: a throwaway backend `detached`
that submits each run as a detached process on this machine (its pid the job id) is added through the recipe's
extension points only (its module, its schema, its conf file, its rules, the two registries), and a sweep on it
is submitted, read back by `train-sweep-status` and collected with each point's exit status: the sweep, its
table and the closing lines know the backend through the launch.Submitter verbs alone.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from package_copy import copy_package, edit, recipe_paths, run_python

from conftest import TINY

RECIPE_HEADING = "**A backend**"

MODULE = '''
"""The detached backend: a run's one rank as a process of its own on this machine, left to run; its pid is its id."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from launcher.exits import ExitStatus
from launcher.launch import JobState
from launcher.spec import RunSpec

WAIT_KEY = "launcher.detached.wait"


def _folder(run_dir: Path) -> Path:
    return Path(run_dir) / "detached"


def describe(spec: RunSpec, run_dir: Path) -> str:
    return f"detached: 1 rank in a process of its own (nice {spec.launcher.detached.nice}), reading {run_dir / 'spec.yaml'}"


def submit(spec: RunSpec, run_dir: Path) -> int:
    folder = _folder(run_dir)
    folder.mkdir(exist_ok=True)
    (folder / "exit_code").unlink(missing_ok=True)  # an earlier job's
    rank = shlex.join([sys.executable, "-m", "launcher.rank.worker", str(Path(run_dir) / "spec.yaml")])
    done, tmp = shlex.quote(str(folder / "exit_code")), shlex.quote(str(folder / "exit_code.tmp"))
    argv = ["nice", "-n", str(spec.launcher.detached.nice), "sh", "-c", f"{rank}; echo $? > {tmp} && mv {tmp} {done}"]
    with open(folder / "job.out", "ab") as log:
        job = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    (folder / "job_id").write_text(f"{job.pid}\\n")
    print(f"submitted job {job.pid}", flush=True)
    return ExitStatus.OK


def status(run_dir: Path) -> JobState | None:
    folder = _folder(run_dir)
    if not (folder / "job_id").is_file():
        return None
    job_id = (folder / "job_id").read_text().strip()
    if (folder / "exit_code").is_file():
        code = int((folder / "exit_code").read_text())
        return JobState(job_id=job_id, state="COMPLETED" if code == 0 else "FAILED", active=False, exit_code=code)
    try:
        os.kill(int(job_id), 0)
    except ProcessLookupError:
        return JobState(job_id=job_id, state=None, active=False, exit_code=0)
    return JobState(job_id=job_id, state="RUNNING", active=True, exit_code=0)


def collect(run_dir: Path) -> int:
    while (state := status(run_dir)) is not None and state.active:
        time.sleep(0.2)
    if state is None or state.state is None:
        return ExitStatus.FAILED
    print(f"job {state.job_id}: {state.state} (exit status {state.exit_code})", flush=True)
    return state.exit_code


def waits(spec: RunSpec) -> bool:
    return spec.launcher.detached.wait


def launch(spec: RunSpec, run_dir: Path) -> int:
    submitted = submit(spec, run_dir)
    return submitted if submitted or not waits(spec) else collect(run_dir)
'''

SCHEMA = '''@dataclass(frozen=True, kw_only=True)
class DetachedConfig:
    """The detached backend's process."""

    nice: int = 0
    """Niceness of the rank's process (0-19)."""
    wait: bool = True
    """Wait for the process to end and return its exit status."""


'''

FIELD = '''    detached: DetachedConfig = field(default_factory=DetachedConfig)
    """The detached backend's process (backend detached only)."""
'''

RULES = '''
"""Rules of the detached backend."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.rules.hardware import Hardware
from launcher.spec import RunSpec, SpecError


def _one_process(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    if spec.launcher.backend != "detached":
        return
    if spec.launcher.world_size != 1:
        yield SpecError(("launcher.nproc", "launcher.nnodes"), "the detached backend runs one rank. Use launcher.nproc=1.")
    if not 0 <= spec.launcher.detached.nice <= 19:
        yield SpecError(("launcher.detached.nice",), f"must be 0-19, got {spec.launcher.detached.nice}.")


RULES = (_one_process,)
'''


def _follow_the_recipe(root: Path) -> set[str]:
    """Add backend `detached` to the package copy at `root`; the repository paths the recipe touched."""
    pkg = root / "launcher"
    (pkg / "launch" / "detached.py").write_text(MODULE)
    edit(pkg / "launch" / "__init__.py", '    "torchrun": "launcher.launch.torchrun",\n',
          '    "detached": "launcher.launch.detached",\n')  # fmt: skip
    config = pkg / "config" / "launcher.py"
    edit(config, 'BACKENDS = ("auto", ', '"detached", ')
    edit(config, "@dataclass(frozen=True, kw_only=True)\nclass LauncherConfig:", SCHEMA, after=False)
    edit(
        config, '    """Resources and preemption settings of the batch job (backend slurm only)."""\n', FIELD
    )
    (pkg / "conf" / "launcher" / "detached.yaml").write_text(
        "backend: detached\nnproc: 1\ndetached:\n  wait: true\n"
    )
    (pkg / "rules" / "detached.py").write_text(RULES)
    edit(pkg / "rules" / "__init__.py", "from launcher.rules import compile as compiling\n",
          "from launcher.rules import detached\n")  # fmt: skip
    edit(pkg / "rules" / "__init__.py", "AREAS = (\n", "    detached,\n")
    edit(
        pkg / "rules" / "keys.py",
        '    "launcher.slurm.wait": FLAG,\n',
        '    "launcher.detached.wait": FLAG,\n',
    )
    return {
        "launcher/launch/detached.py", "launcher/launch/__init__.py", "launcher/config/launcher.py",
        "conf/launcher/detached.yaml", "launcher/rules/detached.py", "launcher/rules/__init__.py",
        "launcher/rules/keys.py",
    }  # fmt: skip


def _recipe_paths() -> set[str]:
    """The files docs/architecture.md's recipe names (with `detached` for the backend)."""
    return recipe_paths(RECIPE_HEADING, {"<name>": "detached"})


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    root = copy_package(tmp_path_factory.mktemp("add_a_backend"))
    return root, _follow_the_recipe(root)


def _run(root: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return run_python(root, *args, timeout=timeout)


def test_the_recipe_names_every_file_it_takes(package_copy: tuple[Path, set[str]]) -> None:
    _, touched = package_copy
    missing = touched - _recipe_paths()
    assert not missing, f"docs/architecture.md's recipe does not name {sorted(missing)}"


def test_a_backend_added_by_the_recipe_is_judged_by_its_rule(package_copy: tuple[Path, set[str]]) -> None:
    root, _ = package_copy
    out = _run(root, "-m", "launcher", "launcher=detached", "launcher.detached.nice=40", "dry_run=true")
    said = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2 and "launcher.detached.nice" in said and "must be 0-19, got 40" in said, said


def test_a_sweep_on_a_submitting_backend_is_submitted_read_and_collected(
    package_copy: tuple[Path, set[str]],
) -> None:
    """Submitted without waiting, read back by train-sweep-status --wait; the same sweep again with waiting skips
    the completed point and collects the other's job with its exit status (3: a non-finite loss stopped it)."""
    root, _ = package_copy
    sweep_dir = root / "sweep"
    args = ["-m", "launcher", "--multirun", *TINY, "train.max_steps=3", "train.eval_every=null",
            "checkpoint.every=null", "scheduler=constant", "scheduler.warmup_steps=0", "train.max_grad_norm=null",
            "train.on_nonfinite=stop", "launcher=detached", "optimizer.lr=1e-3,1e12",
            f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    first = _run(root, *args, "launcher.detached.wait=false")
    assert first.returncode == 0, first.stdout + first.stderr
    jobs = [(sweep_dir / str(n) / "detached" / "job_id").read_text().strip() for n in (0, 1)]
    assert len(set(jobs)) == 2 and all(f"submitted job {j}" in first.stdout for j in jobs), first.stdout
    assert (
        "waiting for" not in first.stdout and "resume:" not in first.stdout
    )  # submitted only: no closing lines

    status = _run(root, "-m", "launcher.front.sweep_status", str(sweep_dir), "--wait")
    assert status.returncode == 1, status.stdout + status.stderr  # one point did not complete
    table = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert [p["status"] for p in table["points"]] == ["completed", "nonfinite"], table
    assert [p["job_id"] for p in table["points"]] == jobs and table["winner"]["point"] == 0
    assert all(j in status.stdout for j in jobs), status.stdout

    again = _run(root, *args)  # launcher.detached.wait=true now: a key the re-run may change
    assert again.returncode == 3, again.stdout + again.stderr  # point 1's job, collected
    assert "sweep point 0: already completed" in again.stdout
    rerun = (sweep_dir / "1" / "detached" / "job_id").read_text().strip()
    assert rerun != jobs[1] and f"job {rerun}: FAILED (exit status 3)" in again.stdout, again.stdout
    assert "waiting for the sweep's 1 submitted job(s) to end" in again.stdout
