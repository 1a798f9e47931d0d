"""A rank killed mid-run: the restart is said on the console, and a reader gets one record per step.
A resumed run: no replay of the previous session's output. Real processes, a real SIGKILL."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from processes import rank_pids, start_train, wait_for_steps

from conftest import TINY, read_metrics, run_cli

LOCAL2 = ["launcher=local", "launcher.nproc=2", "parallel=ddp"]


def _loss_steps(run_dir) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def test_a_restart_is_announced_and_metrics_keep_one_record_per_step(tmp_path) -> None:
    run_dir = tmp_path / "run"
    # 120 steps of ~10 ms: the kill (within a 0.2 s poll of step 12, ~20 steps) lands well before the end.
    args = [*TINY, *LOCAL2, "train.max_steps=120", "checkpoint.every=5", "launcher.max_restarts=1",
            "train.eval_every=null", f"run_dir={run_dir}"]  # fmt: skip
    proc = start_train(args, tmp_path)
    wait_for_steps(run_dir, 12, proc)
    os.kill(rank_pids(run_dir)[1], signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, (tmp_path / "train.err").read_text()[-3000:]
    err = " ".join((tmp_path / "train.err").read_text().split())
    line = re.search(r"restart 1 of 1: rank 1 \(pid \d+\) was killed by signal SIGKILL; all ranks restart, "
                     r"resuming from (\S+) \(step (\d+)\)\.", err)  # fmt: skip
    assert line, err[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == line.group(1) and summary["steps"] == 120
    steps = _loss_steps(run_dir)
    assert steps == list(range(1, 121))  # the replayed steps appear once, from the resumed session
    resumed = int(line.group(2))
    sessions = {r["step"]: r["session"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}
    assert {sessions[s] for s in range(1, resumed + 1)} == {0} and {
        sessions[s] for s in range(resumed + 1, 121)
    } == {1}


# In the extended tier: test_lineage.py::test_a_checkpoint_only_another_rank_cannot_load_is_named_on_the_console
# resumes a 2-rank local run with resume=auto and holds the same: one summary, the previous session's logs
# moved to logs/session_0, one record per step.
@pytest.mark.extended
def test_a_resumed_local_run_does_not_replay_the_previous_output(tmp_path) -> None:
    run_dir = tmp_path / "run"
    args = [*TINY, *LOCAL2, "log.summary_table=true", f"run_dir={run_dir}"]
    first = run_cli([*args, "train.stop_after=10"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli([*args, "resume=auto"], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.count("run summary") == 1 and "stopped_after" not in second.stdout
    assert "logs of the previous session moved to" in second.stderr
    assert (run_dir / "logs" / "session_0" / "rank_0.log").is_file() and (
        run_dir / "logs" / "rank_0.log"
    ).is_file()
    assert _loss_steps(run_dir) == list(range(1, 21))


def test_the_worker_alone_under_torchrun_still_works(tmp_path) -> None:
    """`torchrun -m launcher.rank.worker SPEC` (no `train` around it) takes no lock and needs none."""
    from conftest import free_port, write_spec

    spec = write_spec([*TINY, *LOCAL2, "train.max_steps=4", "checkpoint.every=null"], tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "launcher.rank.worker", str(spec)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (tmp_path / "run" / "run.lock").exists()
