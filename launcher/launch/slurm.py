"""The slurm backend: one batch job per run, a generated sbatch script that `srun`s the ranks.

The script is saved as RUN_DIR/slurm/job.sbatch before it is submitted (`sbatch` on that file alone
resubmits the run), with every value from the config shell-quoted. Each task srun starts runs
`python -m launcher.launch.slurm_rank RUN_DIR/spec.yaml`, which maps SLURM's variables to torch's
and handles preemption (checkpoint, then requeue by global rank 0).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.config.launcher import time_limit_min
from launcher.exits import ExitStatus
from launcher.launch import JobState

if TYPE_CHECKING:
    from launcher.spec import RunSpec

SCRIPT_NAME = "job.sbatch"
JOB_ID_FILE = "job_id"
WAIT_KEY = "launcher.slurm.wait"
"""The key behind `waits`."""


def _sbatch_lines(spec: RunSpec, run_dir: Path) -> list[str]:
    """The #SBATCH options, every configured value shell-quoted."""
    s = spec.launcher.slurm
    q = shlex.quote
    options = [
        f"--job-name={q(spec.name)}",
        f"--nodes={int(spec.launcher.nnodes)}",
        f"--ntasks-per-node={int(spec.launcher.nproc)}",
        f"--output={q(str(run_dir / 'slurm' / '%j.out'))}",
        "--open-mode=append",
        "--requeue",
        f"--signal={q(s.signal)}@{int(s.signal_lead_s)}",
    ]
    if s.time_min is not None:
        options.append(f"--time={time_limit_min(s.time_min)}")
    for key, value in (
        ("partition", s.partition),
        ("account", s.account),
        ("qos", s.qos),
        ("constraint", s.constraint),
    ):
        if value:
            options.append(f"--{key}={q(value)}")
    if s.cpus_per_task is not None:
        options.append(f"--cpus-per-task={int(s.cpus_per_task)}")
    if s.mem_gb is not None:
        options.append(f"--mem={max(1, round(s.mem_gb * 1024))}M")
    if s.gpus_per_node:
        options.append(f"--gpus-per-node={int(s.gpus_per_node)}")
    options.extend(shlex.join(shlex.split(line)) for line in s.extra_sbatch)
    return [f"#SBATCH {option}" for option in options]


def render_script(spec: RunSpec, run_dir: Path, *, python: str | None = None) -> str:
    """The batch script for this run: resources, then srun of one rank entry per task."""
    run_dir = Path(run_dir).resolve()
    q = shlex.quote
    rank_cmd = [python or sys.executable, "-m", "launcher.launch.slurm_rank", str(run_dir / "spec.yaml")]
    signal = q(spec.launcher.slurm.signal)
    return "\n".join(
        [
            "#!/bin/bash",
            f"# The batch job of run {run_dir}; `sbatch` on this file alone resubmits it.",
            *_sbatch_lines(spec, run_dir),
            "",
            'echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST: '
            '$SLURM_NTASKS ranks"',
            f"# A {signal} sent to this shell only (scancel --batch, --signal=B:) is passed on to the ranks.",
            f"trap 'kill -s {signal} \"$ranks\" 2>/dev/null' {signal}",
            f"srun --kill-on-bad-exit=1 {shlex.join(rank_cmd)} &",
            "ranks=$!",
            "# `wait` returns early when a trapped signal arrives: keep waiting until srun has ended.",
            'while kill -0 "$ranks" 2>/dev/null; do wait "$ranks"; done',
            'wait "$ranks"',
            "",
        ]
    )


def describe(spec: RunSpec, run_dir: Path) -> str:
    """The dry run's plan: the script that would be saved and submitted."""
    script = Path(run_dir).resolve() / "slurm" / SCRIPT_NAME
    return f"slurm: sbatch {script}, with this script:\n{render_script(spec, run_dir)}"


def write_script(spec: RunSpec, run_dir: Path) -> Path:
    """Save the batch script in RUN_DIR/slurm/ (private to the user) and return its path."""
    directory = Path(run_dir) / "slurm"
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / SCRIPT_NAME
    path.write_text(render_script(spec, run_dir))
    path.chmod(0o700)
    return path


def submit(spec: RunSpec, run_dir: Path) -> int:
    """Save the script and `sbatch` it; print the job id and logs and return at once (5 when SLURM refuses it)."""
    from rich.console import Console

    from launcher.launch import run_lock, slurm_jobs

    console, err = Console(highlight=False, soft_wrap=True), Console(stderr=True, highlight=False)
    run_dir = Path(run_dir).resolve()
    script = write_script(spec, run_dir)
    try:
        job_id = slurm_jobs.submit(script, chdir=Path.cwd())
    except slurm_jobs.SlurmError as error:
        err.print(f"[red bold]error:[/] {error}", soft_wrap=True)
        err.print(
            f"The script is in {script}; fix launcher.slurm.* (see `sinfo` for partitions) and run again."
        )
        return ExitStatus.SUBMIT_FAILED
    (run_dir / "slurm" / JOB_ID_FILE).write_text(job_id + "\n")
    run_lock.hand_to_job(run_dir, job_id)  # the job holds the run directory now, through requeues
    log = run_dir / "slurm" / f"{job_id}.out"
    console.print(f"submitted job {job_id} ({spec.launcher.nnodes} node(s) x {spec.launcher.nproc} rank(s))")
    console.print(f"  logs:   {log}")
    console.print(f"  follow: tail -f {shlex.quote(str(log))}   |   squeue -j {job_id}")
    return 0


def _job_id(run_dir: Path) -> str | None:
    """The id `submit` left in RUN_DIR/slurm/job_id; None when the run was not submitted."""
    path = Path(run_dir) / "slurm" / JOB_ID_FILE
    return path.read_text().strip() if path.is_file() else None


def status(run_dir: Path) -> JobState | None:
    """The run's job and its state as SLURM reports it (state None: SLURM does not know it); None when not submitted."""
    from launcher.launch import slurm_jobs

    job_id = _job_id(run_dir)
    if job_id is None:
        return None
    try:
        state = slurm_jobs.job_state(job_id)
    except (ValueError, slurm_jobs.SlurmError):
        state = None
    if state is None:
        return JobState(job_id=job_id, state=None, active=False, exit_code=0)
    return JobState(job_id=job_id, state=state.state, active=state.active, exit_code=state.exit_code)


def collect(run_dir: Path) -> int:
    """Wait for the run's job to leave the queue for good, printing its state changes; the run's exit status."""
    from rich.console import Console

    from launcher.launch import slurm_jobs

    job_id = _job_id(run_dir)
    if job_id is None:
        return ExitStatus.FAILED
    console = Console(highlight=False, soft_wrap=True)
    state = slurm_jobs.wait(job_id, poll_s=2.0, on_change=lambda s: console.print(f"job {job_id}: {s.state}"))
    return _final_status(run_dir, state)


def waits(spec: RunSpec) -> bool:
    """launcher.slurm.wait: whether `launch` waits for the job (a sweep submits every point, then collects)."""
    return spec.launcher.slurm.wait


def launch(spec: RunSpec, run_dir: Path) -> int:
    """Submit the job; wait for it unless launcher.slurm.wait=false; the job's exit status (0 once queued)."""
    submitted = submit(spec, run_dir)
    if submitted or not waits(spec):
        return submitted
    return collect(run_dir)


def _final_status(run_dir: Path, state: object) -> int:
    """The run's exit status: the job's own, 1 when SLURM ended it (timeout, cancel, node failure)."""
    code = getattr(state, "exit_code", 1)
    if getattr(state, "state", "") == "COMPLETED":
        return 0
    return code if code else 1
