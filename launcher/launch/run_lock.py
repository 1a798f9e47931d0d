"""One run at a time in a run directory: RUN_DIR/run.lock names the holder (pid, host, start, SLURM job).

`train` takes the lock before it writes spec.yaml and keeps it while the run lasts (inline and
local backends); a SLURM submission hands it to the job, whose rank 0 takes it over when the job
starts, also after a requeue (same job id). A second live run on the same directory is refused
before anything starts (exit status 2, naming the holder); a lock whose holder is gone (a dead
pid on this host, a SLURM job that ended) is taken over with a warning. The lock is created with
O_EXCL, so two processes starting together cannot both win.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

LOCK_FILE = "run.lock"


class RunLockError(RuntimeError):
    """The run directory is held by another live run."""


def lock_path(run_dir: Path) -> Path:
    """Where the lock of a run directory lives."""
    return Path(run_dir) / LOCK_FILE


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), to tell a reused pid apart; None if gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _this_process(job_id: str | None = None) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "pid_start": _start_ticks(os.getpid()),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "slurm_job": job_id,
        "torchrun_job": torchrun_job(),
    }


def torchrun_job(env: Mapping[str, str] | None = None) -> str | None:
    """The rendezvous id of the torchrun job this process belongs to (its restarts keep it), None outside one."""
    env = os.environ if env is None else env
    return env.get("TORCHELASTIC_RUN_ID") or None


def read(run_dir: Path) -> dict[str, Any] | None:
    """The lock's record, None when there is no (readable) lock."""
    try:
        return json.loads(lock_path(run_dir).read_text())
    except (OSError, ValueError):
        return None


def holder_alive(record: dict[str, Any]) -> bool:
    """Whether the run that holds a lock still runs (a holder on another host without a job: assumed alive)."""
    job = record.get("slurm_job")
    if job:
        from launcher.launch import slurm_jobs

        try:
            state = slurm_jobs.job_state(str(job))
        except (ValueError, slurm_jobs.SlurmError):
            return True  # SLURM does not answer here: cannot tell, so not taken over
        return state is not None and state.active
    if record.get("host") != socket.gethostname():
        return True
    pid = int(record.get("pid", 0))
    return pid > 0 and _start_ticks(pid) is not None and _start_ticks(pid) == record.get("pid_start")


def describe(record: dict[str, Any]) -> str:
    """Who holds a lock, for messages."""
    who = f"SLURM job {record['slurm_job']}" if record.get("slurm_job") else f"pid {record.get('pid')}"
    started = record.get("started")
    return f"{who} on host {record.get('host') or 'unknown'}" + (f" since {started}" if started else "")


def conflict(run_dir: Path) -> str | None:
    """Why a new run may not use `run_dir` (a live holder), None when it may."""
    record = read(run_dir)
    if record is None or not holder_alive(record):
        return None
    if record.get("torchrun_job") is not None and record.get("torchrun_job") == torchrun_job():
        return None  # rank 0 of this very torchrun job holds it (rank 0 itself still takes it by acquire)
    return _in_use(run_dir, record)


def _in_use(run_dir: Path, record: dict[str, Any]) -> str:
    return (
        f"{run_dir} is in use by another run ({describe(record)}; lock file {lock_path(run_dir)}). Wait for "
        "it to end, or choose another run_dir. If that run is gone for good (e.g. its host is down), "
        "remove the lock file."
    )


def _create(path: Path, record: dict[str, Any]) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(record) + "\n")
    return True


def acquire(run_dir: Path, *, job_id: str | None = None) -> dict[str, Any]:
    """Take the lock of `run_dir` for this process (RunLockError when a live run holds it).

    A stale lock (its holder is gone) is taken over with a warning; the lock of the same SLURM job
    (a requeued job) or of the same torchrun job (a restart) is taken over silently.
    """
    path = lock_path(run_dir)
    record = _this_process(job_id)
    for _ in range(3):  # another process may replace a stale lock at the same time
        if _create(path, record):
            return record
        held = read(run_dir)
        if held is None:
            continue
        ours = record["torchrun_job"]
        same_job = (job_id is not None and str(held.get("slurm_job")) == str(job_id)) or (
            ours not in (None, "none") and held.get("torchrun_job") == ours
        )  # a requeued SLURM job, or a restart of one torchrun job (rank 0 may move hosts); torchrun's
        # default id "none" names no job: two jobs may share it
        if not same_job and holder_alive(held):
            raise RunLockError(_in_use(run_dir, held))
        if not same_job:
            warnings.warn(
                f"taking over the lock of {run_dir}: its holder ({describe(held)}) is gone", stacklevel=2
            )
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    raise RunLockError(f"could not take the lock {path}: other processes keep replacing it")


def hand_to_job(run_dir: Path, job_id: str) -> None:
    """Give the lock to a submitted SLURM job: it holds the directory until it ends (requeues included)."""
    tmp = lock_path(run_dir).with_suffix(".tmp")
    tmp.write_text(json.dumps({**_this_process(job_id), "pid": None, "pid_start": None}) + "\n")
    tmp.replace(lock_path(run_dir))


def release(run_dir: Path, record: dict[str, Any]) -> None:
    """Remove the lock if it is still the one `record` describes (not handed over, not taken over)."""
    held = read(run_dir)
    if (
        held is not None
        and held.get("pid") == record.get("pid")
        and held.get("started") == record.get("started")
    ):
        with contextlib.suppress(FileNotFoundError):
            lock_path(run_dir).unlink()


@contextlib.contextmanager
def holding(run_dir: Path) -> Iterator[dict[str, Any]]:
    """Hold the lock of `run_dir` for the duration of the block."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    record = acquire(run_dir)
    try:
        yield record
    finally:
        release(run_dir, record)
