"""Talking to SLURM: validated job ids, sbatch, job states, requeue. Every command gets an argv list."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# 123, an array task 123_4, an array 123_[1-3,5%2], a heterogeneous component 123+1.
_JOB_ID = re.compile(r"^[0-9]{1,12}(?:_(?:[0-9]{1,9}|\[[0-9,\-%]{1,64}\]))?(?:\+[0-9]{1,4})?$")
ACTIVE_STATES = frozenset(
    {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING",
     "SUSPENDED", "RESIZING", "STAGE_OUT", "SIGNALING", "RESV_DEL_HOLD"}
)  # fmt: skip
COMMAND_TIMEOUT_S = 60


class SlurmError(RuntimeError):
    """A SLURM command failed; the message carries SLURM's own reason."""


def valid_job_id(value: str | None) -> str:
    """`value` if it is a SLURM job id (digits, array or het forms), else ValueError: never a shell word."""
    text = (value or "").strip()
    if not _JOB_ID.fullmatch(text):
        raise ValueError(f"not a SLURM job id: {value!r} (expected digits, e.g. 1234 or 1234_5)")
    return text


def available() -> str | None:
    """None when a SLURM controller answers here, else why not (for skips and messages)."""
    if shutil.which("sinfo") is None:
        return "no `sinfo` on PATH (SLURM's client tools are not installed)"
    try:
        result = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "`sinfo` did not answer within 30 s"
    if result.returncode != 0:
        return f"`sinfo` failed: {result.stderr.strip() or result.returncode}"
    return None


def _run(argv: list[str], timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError as err:
        raise SlurmError(f"`{argv[0]}` is not installed here: {err}") from err
    except subprocess.TimeoutExpired as err:
        raise SlurmError(f"`{' '.join(argv)}` did not answer within {timeout_s:.0f} s") from err


def submit(script: Path, *, chdir: Path) -> str:
    """`sbatch --parsable SCRIPT`; the job id, or SlurmError with sbatch's own reason."""
    result = _run(["sbatch", "--parsable", f"--chdir={chdir}", str(script)])
    if result.returncode != 0:
        reason = result.stderr.strip() or result.stdout.strip() or f"exit status {result.returncode}"
        raise SlurmError(f"sbatch refused the job: {reason}")
    return valid_job_id(result.stdout.strip().split(";")[0])


@dataclass(frozen=True, kw_only=True)
class JobState:
    """A job's state as SLURM reports it."""

    state: str
    """SLURM's state name, e.g. PENDING, RUNNING, COMPLETED, FAILED."""
    exit_code: int
    """The batch script's exit status (0 while the job runs)."""
    restarts: int
    """How many times the job was requeued."""

    @property
    def active(self) -> bool:
        """The job is queued or running (it may still change)."""
        return self.state in ACTIVE_STATES


def _from_scontrol(job_id: str) -> JobState | None:
    result = _run(["scontrol", "-o", "show", "job", job_id])
    if result.returncode != 0:
        return None  # finished long ago: no longer in the controller's memory
    fields = dict(pair.split("=", 1) for pair in result.stdout.split() if "=" in pair)
    return JobState(
        state=fields.get("JobState", "UNKNOWN"),
        exit_code=int(fields.get("ExitCode", "0:0").split(":")[0]),
        restarts=int(fields.get("Restarts", "0")),
    )


def _from_sacct(job_id: str) -> JobState | None:
    result = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"])
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    if result.returncode != 0 or not lines:
        return None
    state, exit_code = lines[-1].split("|")[:2]
    return JobState(state=state.split()[0], exit_code=int(exit_code.split(":")[0]), restarts=0)


def job_state(job_id: str) -> JobState | None:
    """The job's state from the controller, else from accounting; None if SLURM knows no such job."""
    job_id = valid_job_id(job_id)
    return _from_scontrol(job_id) or _from_sacct(job_id)


def wait(
    job_id: str, *, poll_s: float = 1.0, on_change: Callable[[JobState], None] | None = None
) -> JobState:
    """Poll until the job leaves the queue for good (through requeues); its final state."""
    last = None
    while True:
        state = job_state(job_id)
        if state is not None and (last is None or state.state != last.state):
            if on_change:
                on_change(state)
            last = state
        if state is not None and not state.active:
            return state
        time.sleep(poll_s)


def requeue(job_id: str) -> None:
    """`scontrol requeue JOB_ID`: end this run of the job and queue it again (same id, same script)."""
    result = _run(["scontrol", "requeue", valid_job_id(job_id)])
    if result.returncode != 0:
        raise SlurmError(f"scontrol requeue {job_id} failed: {result.stderr.strip()}")


def hostnames(nodelist: str) -> list[str]:
    """`scontrol show hostnames NODELIST`: the expanded host names of a compressed node list."""
    if not re.fullmatch(r"[A-Za-z0-9_.,\-\[\]]+", nodelist):
        raise ValueError(f"not a SLURM node list: {nodelist!r}")
    result = _run(["scontrol", "show", "hostnames", nodelist])
    if result.returncode != 0:
        raise SlurmError(f"scontrol show hostnames {nodelist} failed: {result.stderr.strip()}")
    return result.stdout.split()
