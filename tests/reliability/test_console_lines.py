"""What the console says when something goes wrong reads as plain sentences: no raw markup, one line
per warning (once, without Python's `UserWarning` prefix and source line), no "since None", no "..".
"""

from __future__ import annotations

import socket
import subprocess

from processes import mount_tmpfs, stale_lock

from conftest import run_cli
from launcher.launch.local import failure_message

SMALL = [
    "model.n_layer=1", "model.d_model=32", "model.n_head=2", "data.seq_len=16", "data.max_bytes=100000",
    "scheduler.warmup_steps=1", "train.eval_every=null", "log.progress=false", "log.summary_table=false",
]  # fmt: skip


def test_a_full_disk_error_is_printed_as_text_not_as_markup(tmp_path) -> None:
    disk = tmp_path / "disk"
    mount_tmpfs(disk, 160 * 1024)
    try:  # the run's files fit in 160 KiB, its first checkpoint (about 144 KB) does not
        result = run_cli(
            [*SMALL, "train.max_steps=2", "checkpoint.every=2", f"run_dir={disk / 'run'}"], tmp_path
        )
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 1 and "error: could not write the checkpoint of step 2" in out, out[-3000:]
    assert "[red]" not in out and "[/]" not in out
    assert "[enforce fail" in out  # square brackets of the error itself are kept, not read as markup


def test_warnings_print_once_as_one_line_and_a_lock_without_a_start_time_is_described(tmp_path) -> None:
    run_dir = tmp_path / "run"
    first = run_cli([*SMALL, "train.max_steps=4", "checkpoint.every=2", f"run_dir={run_dir}"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir / "checkpoints" / "step_4" / "COMPLETE").unlink()
    gone_pid = stale_lock(run_dir)  # no "started"
    again = run_cli(
        [*SMALL, "train.max_steps=6", "checkpoint.every=2", "resume=auto", f"run_dir={run_dir}"], tmp_path
    )
    assert again.returncode == 0, again.stderr[-3000:]
    lines = again.stderr.splitlines()
    skipped = [line for line in lines if "skipping checkpoint" in line]
    assert skipped == [f"warning: skipping checkpoint {run_dir}/checkpoints/step_4: no COMPLETE marker (the save did not finish)"]  # fmt: skip
    taken = [line for line in lines if "taking over the lock" in line]
    assert taken == [f"warning: taking over the lock of {run_dir}: its holder (pid {gone_pid} on host {socket.gethostname()}) is gone"]  # fmt: skip
    assert "UserWarning" not in again.stderr and "None" not in again.stderr


def test_a_rank_error_that_ends_in_a_period_gets_no_second_one(tmp_path, monkeypatch) -> None:
    """The error file is torch elastic's own, written by its ErrorHandler as a failing rank writes it."""
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ErrorHandler,
        ProcessFailure,
    )

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise ValueError("the batch does not fit.")
    except ValueError as err:
        ErrorHandler().record_exception(err)
    failure = ProcessFailure(local_rank=1, pid=4321, exitcode=1, error_file=str(error_file))
    first_line = failure_message(ChildFailedError("worker", {1: failure}), tmp_path).splitlines()[0]
    assert first_line == "error: rank 1 (pid 4321) failed: ValueError: the batch does not fit."
