"""On a real SLURM: a 2-rank job matches the local launcher, requeue and preemption resume exactly, sweeps, errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import TINY, losses, run_cli, run_inline
from launcher.components import checkpoint
from launcher.launch import slurm_jobs

pytestmark = pytest.mark.slurm
_NO_SLURM = slurm_jobs.available()


@pytest.fixture(autouse=True)
def _needs_slurm() -> None:
    """Skip, saying why, only where no SLURM controller answers (`sinfo` fails)."""
    if _NO_SLURM:
        pytest.skip(
            f"no SLURM cluster reachable: {_NO_SLURM} (start one: sudo bash scripts/slurm_cluster.sh up)"
        )


# Long enough that a signal sent after the first logged step lands mid-run, short enough for CI.
BASE = [*TINY, "train.max_steps=40", "checkpoint.every=5", "train.eval_every=20"]
DDP = [*BASE, "parallel=ddp", "launcher.nproc=2"]
JOB_TIMEOUT_S = 480


def _wait_for(what: str, predicate: Callable[[], bool], timeout_s: float = JOB_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _submit(overrides: list[str], run_dir: Path, cwd: Path) -> str:
    result = run_cli([*overrides, "launcher=slurm", "launcher.slurm.wait=false", f"run_dir={run_dir}"], cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    return (run_dir / "slurm" / "job_id").read_text().strip()


def _finish(job_id: str, run_dir: Path) -> dict:
    state = slurm_jobs.wait(job_id, poll_s=0.5)
    log = (run_dir / "slurm" / f"{job_id}.out").read_text()
    assert state.state == "COMPLETED", log
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The same 2-rank DDP run with the local launcher (torch's elastic agent) on this machine."""
    cwd = tmp_path_factory.mktemp("reference")
    result = run_cli([*DDP, "launcher=local", f"run_dir={cwd / 'run'}"], cwd, timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = cwd / "run"
    return losses(run_dir)


def test_two_rank_job_matches_the_local_launcher(tmp_path, ddp_reference) -> None:
    run_dir = tmp_path / "run"
    result = run_cli([*DDP, "launcher=slurm", f"run_dir={run_dir}"], tmp_path, timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    assert f"submitted job {job_id}" in result.stdout
    assert (
        f"tail -f {run_dir / 'slurm' / job_id}.out" in result.stdout
        and f"squeue -j {job_id}" in result.stdout
    )
    assert (run_dir / "slurm" / "job.sbatch").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["exit_reason"] == "completed"
    assert losses(run_dir) == pytest.approx(ddp_reference, rel=1e-6)


def test_preemption_signal_checkpoints_requeues_and_resumes(tmp_path, ddp_reference) -> None:
    run_dir = tmp_path / "run"
    job_id = _submit(DDP, run_dir, tmp_path)
    _wait_for("the first logged step", lambda: _logged_steps(run_dir) >= 1)
    # To the batch shell only: its trap passes the signal through srun to both ranks.
    subprocess.run(["scancel", "--signal=USR2", "--batch", job_id], check=True)
    summary = _finish(job_id, run_dir)
    log = (run_dir / "slurm" / f"{job_id}.out").read_text()
    assert "preempted: checkpoint written, requeueing" in log
    assert "(restart 1)" in log and summary["resumed_from"] is not None
    stopped_at = checkpoint.step_of(Path(summary["resumed_from"]))
    assert 0 < stopped_at < 40  # both ranks stopped at the same step and saved it
    assert losses(run_dir) == pytest.approx(ddp_reference, rel=1e-6)


@pytest.mark.extended  # a requeued job resuming from its checkpoint: the preemption case above (USR2, checkpoint,
# requeue, resume, the local launcher's losses)
def test_scontrol_requeue_resumes_from_the_checkpoint(tmp_path) -> None:
    straight, run_dir = tmp_path / "straight", tmp_path / "run"
    assert run_inline(BASE, straight) == 0
    job_id = _submit(BASE, run_dir, tmp_path)
    _wait_for("a checkpoint", lambda: bool(checkpoint.good_checkpoints(run_dir, warn=False)))
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    summary = _finish(job_id, run_dir)
    assert summary["resumed_from"] is not None, (run_dir / "slurm" / f"{job_id}.out").read_text()
    assert summary["steps"] == 40
    assert losses(run_dir) == losses(straight)  # resume is exact: the same floats


@pytest.mark.extended  # a sweep submitted without waiting, read back by train-sweep-status --wait and re-run:
# test_add_a_backend.py's sweep on a submitting backend; SLURM's submit and job-state verbs: the two tests above
def test_sweep_submits_one_job_per_point_and_collects(tmp_path) -> None:
    sweep_dir = tmp_path / "sweep"
    args = ["--multirun", *TINY, "train.max_steps=6", "launcher=slurm", "launcher.slurm.wait=false",
            "optimizer.lr=1e-3,3e-4", f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    result = run_cli(args, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = [(sweep_dir / str(n) / "slurm" / "job_id").read_text().strip() for n in (0, 1)]
    assert len(set(jobs)) == 2 and all(f"submitted job {j}" in result.stdout for j in jobs)
    status = subprocess.run([sys.executable, "-m", "launcher.front.sweep_status", str(sweep_dir), "--wait"],
                            capture_output=True, text=True, timeout=JOB_TIMEOUT_S)  # fmt: skip
    assert status.returncode == 0, status.stdout + status.stderr
    table = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert [p["status"] for p in table["points"]] == ["completed", "completed"]
    assert table["winner"]["point"] in (0, 1) and "winner" in status.stdout
    again = run_cli(args, tmp_path)  # the same sweep again: every point is done, nothing is submitted
    assert again.returncode == 0 and again.stdout.count("already completed") == 2, again.stdout


@pytest.mark.extended  # trials as jobs of a submitting backend: test_add_a_backend.py's sweep; SLURM's submit
# and job-state verbs: the first two tests here; the study's side (values told, trials continued): test_optuna_sweep.py
def test_optuna_sweep_submits_a_batch_of_trials_and_tells_the_study(tmp_path) -> None:
    sweep_dir = tmp_path / "sweep"
    args = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2", *TINY,
            "train.max_steps=6", "train.eval_at_end=true", "launcher=slurm", "launcher.slurm.wait=false",
            "optimizer.lr=tag(log, interval(1e-4, 1e-2))", f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    result = run_cli(args, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = [(sweep_dir / str(n) / "slurm" / "job_id").read_text().strip() for n in (0, 1)]
    assert len(set(jobs)) == 2 and all(f"submitted job {j}" in result.stdout for j in jobs)
    table = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert [t["state"] for t in table["study"]["trials"]] == ["complete", "complete"]
    for trial in table["study"]["trials"]:  # collected, then told from the job's own summary.json
        summary = json.loads((sweep_dir / str(trial["trial"]) / "summary.json").read_text())
        assert trial["value"] == summary["eval_loss"]


def test_unknown_partition_fails_at_submission_with_slurms_reason_and_status_5(tmp_path) -> None:
    args = [
        *TINY,
        "launcher=slurm",
        "launcher.slurm.partition=nosuchpartition",
        f"run_dir={tmp_path / 'run'}",
    ]
    result = run_cli(args, tmp_path, timeout=120)
    assert result.returncode == 5, result.stdout + result.stderr  # submission failed, not an invalid spec
    assert "sbatch refused the job" in result.stderr and "invalid partition" in result.stderr.lower()
