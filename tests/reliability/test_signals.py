"""Ctrl-C and SIGTERM: the first stops every rank after its step with a complete checkpoint, a
second stops at once; exit 130 / 143; never an orphan rank. Real processes, real signals."""

from __future__ import annotations

import ipaddress
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from processes import (
    LONG_DDP,
    listening_sockets,
    process_tree,
    rank_pids,
    send,
    start_train,
    wait_for_steps,
)

from conftest import alive
from launcher.components import checkpoint


@dataclass(frozen=True)
class Stopped:
    """A 2-rank `train` run stopped by one signal after its fifth step, and what it held just before the signal."""

    run_dir: Path
    status: int
    rank_pids: list[int]
    sockets: list[tuple[int, str, int]]
    err: str


@pytest.fixture(scope="module")
def stopped_by(tmp_path_factory):
    """A LONG_DDP run per signal, shared by the signal's test and the loopback test (one launch of 2 ranks each)."""
    runs: dict[signal.Signals, Stopped] = {}

    def stop(number: signal.Signals) -> Stopped:
        if number not in runs:
            cwd = tmp_path_factory.mktemp(number.name)
            run_dir = cwd / "run"
            proc = start_train([*LONG_DDP, f"run_dir={run_dir}"], cwd)
            try:
                wait_for_steps(run_dir, 5, proc)
                pids, sockets = rank_pids(run_dir), listening_sockets(process_tree(proc.pid))
            finally:
                send(proc, number)
                status = proc.wait(timeout=120)
            runs[number] = Stopped(run_dir, status, pids, sockets, (cwd / "train.err").read_text()[-3000:])
        return runs[number]

    return stop


# SIGINT in the extended tier: the handler is one for both signals; SIGTERM holds it here, and SIGINT's
# checkpoint and status are held by test_an_inline_run_stops_on_sigint_with_a_checkpoint and
# test_second_sigint_stops_at_once_without_orphans.
@pytest.mark.parametrize(
    ("number", "status"),
    [pytest.param(signal.SIGINT, 130, marks=pytest.mark.extended), (signal.SIGTERM, 143)],
)
def test_first_signal_checkpoints_every_rank_and_exits_128_plus_signal(stopped_by, number, status) -> None:
    stopped = stopped_by(number)
    assert stopped.status == status, stopped.err
    summary = json.loads((stopped.run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "interrupted" and summary["signal"] == number.name
    newest = checkpoint.good_checkpoints(stopped.run_dir)[0]
    assert checkpoint.step_of(newest) == summary["steps"] > 5  # saved at the step both ranks stopped at
    assert not [p for p in stopped.rank_pids if alive(p)]


def test_second_sigint_stops_at_once_without_orphans(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = start_train([*LONG_DDP, "checkpoint.every=20", f"run_dir={run_dir}"], tmp_path)
    wait_for_steps(run_dir, 25, proc)
    pids = rank_pids(run_dir)
    send(proc, signal.SIGINT)
    send(proc, signal.SIGINT)
    started = time.monotonic()
    code = proc.wait(timeout=60)
    assert code == 130 and time.monotonic() - started < 30, (tmp_path / "train.err").read_text()[-3000:]
    deadline = time.monotonic() + 15
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)]
    assert checkpoint.good_checkpoints(run_dir)  # the checkpoint of step 20 is intact


def test_an_inline_run_stops_on_sigint_with_a_checkpoint(tmp_path) -> None:
    run_dir = tmp_path / "run"
    args = [a for a in LONG_DDP if not a.startswith(("launcher", "parallel"))]
    proc = start_train([*args, f"run_dir={run_dir}"], tmp_path)
    wait_for_steps(run_dir, 5, proc)
    send(proc, signal.SIGINT)
    assert proc.wait(timeout=120) == 130, (tmp_path / "train.err").read_text()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "interrupted"
    assert checkpoint.step_of(checkpoint.good_checkpoints(run_dir)[0]) == summary["steps"]


def test_a_single_node_run_listens_on_loopback_only(stopped_by) -> None:
    """The launcher's rendezvous store, the ranks' store and gloo's sockets: none on an outside address."""
    found = stopped_by(signal.SIGTERM).sockets  # the SIGTERM test's run, read before its signal
    assert found, "the run should hold listening sockets (its stores); none were found"
    outside = [s for s in found if not ipaddress.ip_address(s[1]).is_loopback]
    assert not outside, f"sockets listening beyond loopback: {outside}"
