"""A 2-rank local run killed with SIGKILL, the launching process's whole group at once (a scheduler, a
terminal's hang-up), leaves none of its POSIX semaphores (/dev/shm/sem.mp-*) behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from processes import LONG_DDP, rank_pids, start_train, wait_for_steps

from conftest import alive


def _semaphores(pid: int) -> set[str]:
    """The /dev/shm/sem.* files process `pid` has open (a named semaphore is a mapping of its file)."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[-1] for line in lines if "/dev/shm/sem." in line}


def test_a_sigkill_of_the_launcher_group_leaves_no_semaphores(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = start_train([*LONG_DDP, f"run_dir={run_dir}"], tmp_path)
    wait_for_steps(run_dir, 2, proc)
    pids = rank_pids(run_dir)
    names = set().union(*(_semaphores(pid) for pid in pids))
    assert len(names) == 9 and all(Path(name).exists() for name in names), (
        names
    )  # the agent's queues and event
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while (
        [p for p in pids if alive(p)] or any(Path(n).exists() for n in names)
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)]
    assert not [n for n in names if Path(n).exists()]
