"""SLURM with two nodes for real: one slurmctld and two slurmd, each slurmd in its own network namespace
(scripts/slurm_two_nodes.sh); `train launcher=slurm launcher.nnodes=2` submits from node 1's network.

Too slow for the default suite (a cluster to start, jobs to wait for): they run with `-m netns` or
`-m slurm`, and skip, naming the reason, where namespaces or SLURM's daemons are missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import TINY, losses

pytestmark = [pytest.mark.netns, pytest.mark.slurm]

SCRIPT = Path(__file__).parents[2] / "scripts" / "slurm_two_nodes.sh"
# Long enough that a signal sent after the first logged step lands mid-run.
DDP = [*TINY, "train.max_steps=30", "checkpoint.every=5", "train.eval_every=15", "parallel=ddp"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # the same intra-op threads in every rank: bitwise losses


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "a two-node SLURM in network namespaces needs root"
    for tool in ("ip", "nsenter", "unshare", "slurmctld", "slurmd", "sbatch"):
        if shutil.which(tool) is None:
            return f"a two-node SLURM needs `{tool}`, which is not installed (scripts/slurm_cluster.sh up installs SLURM)"
    return None


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory) -> Iterator[dict[str, str]]:
    """Two SLURM nodes (namespaces named after this process); the environment that reaches them."""
    if not {"netns", "slurm"} & set((request.config.option.markexpr or "").replace("(", " ").split()):
        pytest.skip(
            "a two-node SLURM (about a minute here): too slow for the default suite, runs with -m netns"
        )
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    tag = os.getpid()
    env = {
        **os.environ,
        **ONE_THREAD,
        "NETNS_PREFIX": f"s{tag}n",
        "NETNS_BRIDGE": f"sb{tag}",
        "NETNS_SUBNET": "10.78.0",
        "SLURM_TWO_DIR": str(tmp_path_factory.mktemp("slurm_two_nodes")),
    }
    up = subprocess.run(["bash", str(SCRIPT), "up"], env=env, capture_output=True, text=True)
    if up.returncode != 0:
        subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True)
        pytest.skip(f"the two-node SLURM did not come up here: {up.stderr.strip()[-400:]}")
    try:
        yield env
    finally:
        subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True)


def _on_node_1(
    env: dict[str, str], cmd: list[str], cwd: Path, timeout: int = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), "run", *cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def _reference(run_dir: Path, cwd: Path) -> subprocess.Popen:
    """The same run on one node with two local ranks (loopback), started alongside the job."""
    cmd = [sys.executable, "-m", "launcher", *DDP, "launcher=local", "launcher.nproc=2", f"run_dir={run_dir}"]
    env = {**os.environ, **ONE_THREAD}
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _train(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "launcher", *DDP, "launcher=slurm", "launcher.nnodes=2", "launcher.nproc=1",
        "launcher.timeout_s=60", f"run_dir={run_dir}", *extra,
    ]  # fmt: skip


def _reference_losses(reference: subprocess.Popen, run_dir: Path) -> dict[int, float]:
    out, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, (out + err)[-3000:]
    return losses(run_dir)


def test_a_two_node_job_matches_one_node_with_the_same_world_size(cluster, tmp_path) -> None:
    reference = _reference(tmp_path / "one", tmp_path)
    run_dir = tmp_path / "two"
    result = _on_node_1(cluster, _train(run_dir), tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    log = (run_dir / "slurm" / f"{job_id}.out").read_text()
    assert "on n[1-2]: 2 ranks" in log, log[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["exit_reason"] == "completed"
    assert losses(run_dir) == _reference_losses(reference, tmp_path / "one")  # bitwise


def test_preemption_across_two_nodes_checkpoints_requeues_and_resumes_exactly(cluster, tmp_path) -> None:
    reference = _reference(tmp_path / "one", tmp_path)
    run_dir = tmp_path / "two"
    result = _on_node_1(cluster, _train(run_dir, "launcher.slurm.wait=false"), tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, "no step was logged"
        time.sleep(0.05)
    # To the batch shell only: its trap passes the signal through srun to the ranks on both nodes.
    signal = _on_node_1(cluster, ["scancel", "--signal=USR2", "--batch", job_id], tmp_path)
    assert signal.returncode == 0, signal.stderr
    summary: dict = {}
    while summary.get("exit_reason") != "completed":
        assert time.monotonic() < deadline, (run_dir / "slurm" / f"{job_id}.out").read_text()[-3000:]
        time.sleep(0.2)
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            summary = {}
    log = (run_dir / "slurm" / f"{job_id}.out").read_text()
    assert "preempted: checkpoint written, requeueing" in log and "(restart 1) on n[1-2]" in log, log[-3000:]
    assert summary["resumed_from"] is not None and summary["steps"] == 30
    assert losses(run_dir) == _reference_losses(reference, tmp_path / "one")  # bitwise, resumed steps too


def test_the_time_limit_warning_checkpoints_both_nodes_before_the_limit_and_requeues(
    cluster, tmp_path
) -> None:
    """--time=1 with --signal=USR2@40: the warning comes 20-50 s in (SLURM checks limits every ~30 s)."""
    run_dir = tmp_path / "limited"
    long_run = [
        "train.max_steps=100000", "checkpoint.every=100000", "train.log_every=50", "launcher.slurm.wait=false",
        "launcher.slurm.time_min=1", "launcher.slurm.signal_lead_s=40", "launcher.slurm.max_requeues=1",
    ]  # fmt: skip
    result = _on_node_1(cluster, _train(run_dir, *long_run), tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    log_path, deadline = run_dir / "slurm" / f"{job_id}.out", time.monotonic() + 240
    while "resumed from" not in (log_path.read_text() if log_path.is_file() else ""):
        assert time.monotonic() < deadline, log_path.read_text()[-3000:] if log_path.is_file() else "no log"
        time.sleep(0.5)
    _on_node_1(cluster, ["scancel", job_id], tmp_path)
    log = log_path.read_text()
    assert "preempted: checkpoint written, requeueing" in log and "(restart 1) on n[1-2]" in log, log[-3000:]
    assert "DUE TO TIME LIMIT" not in log  # the warning came first: the limit itself never struck
    saved = [p.name for p in (run_dir / "checkpoints").glob("step_*")]
    assert (
        len(saved) == 1 and f"resumed from {run_dir / 'checkpoints' / saved[0]}" in log
    )  # the warning's checkpoint
