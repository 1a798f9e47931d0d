"""One rank of a SLURM job: SLURM's variables to torch's, a preemption handler, the worker, requeue.

`srun` starts this once per task: `python -m launcher.launch.slurm_rank RUN_DIR/spec.yaml`.
On the preemption signal the engine writes a complete checkpoint on every rank and the run ends
with exit status 4 (ExitStatus.PREEMPTED); then global rank 0 alone requeues the job (`scontrol requeue`, at most
launcher.slurm.max_requeues times, counted by SLURM_RESTART_COUNT) and the requeued job resumes
from that checkpoint. The other ranks wait to be ended by the requeue: a rank that exited first
with a failure status would make srun kill rank 0 before it could requeue.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from launcher.components import collector
from launcher.exits import ExitStatus
from launcher.launch import run_lock, slurm_jobs

BASE_PORT, PORT_RANGE = 20000, 20000
REQUEUE_GRACE_S = 120.0


def rendezvous_port(job_id: str, port: int | None) -> int:
    """The configured port, else one derived from the job id (jobs sharing a node do not collide)."""
    if port is not None:
        return port
    return BASE_PORT + int(slurm_jobs.valid_job_id(job_id).split("_")[0].split("+")[0]) % PORT_RANGE


def torch_environment(env: Mapping[str, str], *, master_addr: str, port: int | None) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from SLURM's per-task variables."""
    job_id = slurm_jobs.valid_job_id(env.get("SLURM_JOB_ID"))
    return {
        "RANK": str(int(env["SLURM_PROCID"])),
        "WORLD_SIZE": str(int(env["SLURM_NTASKS"])),
        "LOCAL_RANK": str(int(env["SLURM_LOCALID"])),
        "LOCAL_WORLD_SIZE": str(int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(rendezvous_port(job_id, port)),
    }


def restart_count(env: Mapping[str, str]) -> int:
    """How many times SLURM has requeued this job (0 on its first run)."""
    value = env.get("SLURM_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def should_requeue(code: int, restarts: int, max_requeues: int) -> bool:
    """A preempted run requeues while it has requeues left."""
    return code == ExitStatus.PREEMPTED and restarts < max_requeues


def _after_preemption(code: int, rank: int, job_id: str, max_requeues: int) -> int:
    """Requeue on rank 0 (the others wait to be ended by it); the exit status of this rank."""
    restarts = restart_count(os.environ)
    if not should_requeue(code, restarts, max_requeues):
        if code == ExitStatus.PREEMPTED and rank == 0:
            print(
                f"preempted after {restarts} requeue(s), launcher.slurm.max_requeues={max_requeues} reached: "
                "not requeued. The checkpoint is complete; resubmit with `sbatch RUN_DIR/slurm/job.sbatch`.",
                flush=True,
            )
        return code
    if rank == 0:
        print(f"preempted: checkpoint written, requeueing job {job_id} (restart {restarts + 1})", flush=True)
        try:
            slurm_jobs.requeue(job_id)
        except slurm_jobs.SlurmError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            return code
    time.sleep(REQUEUE_GRACE_S)  # SLURM ends this process as it requeues the job
    return code


def run(spec_path: Path) -> int:
    """Run this task as a rank of the job; returns its exit status."""
    from launcher.rank import worker
    from launcher.spec import load_spec

    spec = load_spec(spec_path)
    settings = spec.launcher.slurm
    job_id = slurm_jobs.valid_job_id(os.environ.get("SLURM_JOB_ID"))
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "localhost")
    master = slurm_jobs.hostnames(nodes)[0]
    env = torch_environment(os.environ, master_addr=master, port=settings.port)
    os.environ.update(env)
    run_dir, rank = Path(spec.run_dir or Path(spec_path).parent), int(env["RANK"])
    try:  # rank 0 holds the run directory for the job (a requeued run of the same job takes it over)
        lock = run_lock.acquire(run_dir, job_id=job_id) if rank == 0 else None
    except run_lock.RunLockError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return ExitStatus.INVALID_SPEC
    code = worker.run_process(Path(spec_path), preemption=settings.signal)
    if lock is not None and not should_requeue(code, restart_count(os.environ), settings.max_requeues):
        run_lock.release(run_dir, lock)
    return _after_preemption(code, rank, job_id, settings.max_requeues)


def main() -> None:
    """`python -m launcher.launch.slurm_rank SPEC_YAML`: what each srun task runs."""
    collector.pause()  # the rank's imports and build (as inline's); the loop collects at its own pauses
    sys.exit(run(Path(sys.argv[1])))


if __name__ == "__main__":
    main()
