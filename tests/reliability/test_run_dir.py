"""One run directory, one run: a second live `train` is refused naming the holder; a stale lock is
taken over. And configs that try to run code or name unusable paths are refused before anything starts."""

from __future__ import annotations

import json
import signal
import socket

import pytest
from processes import LONG_DDP, send, stale_lock, start_train, wait_for_steps

from conftest import TINY, run_cli
from launcher.launch import run_lock


def test_a_second_run_on_a_live_run_dir_is_refused_naming_the_holder(tmp_path) -> None:
    run_dir = tmp_path / "run"
    first = start_train([*LONG_DDP, f"run_dir={run_dir}"], tmp_path)
    try:
        wait_for_steps(run_dir, 3, first)
        second = run_cli([*TINY, f"run_dir={run_dir}", "resume=auto"], tmp_path)
        err = " ".join(second.stderr.split())
        assert second.returncode == 2, err
        assert f"is in use by another run (pid {first.pid} on host {socket.gethostname()}" in err
        assert "run.lock" in err
    finally:
        send(first, signal.SIGTERM)
        first.wait(timeout=120)
    assert not run_lock.lock_path(run_dir).exists()  # released when the first run ended


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stale_lock(run_dir, started="earlier")
    result = run_cli([*TINY, "train.max_steps=3", "checkpoint.every=null", f"run_dir={run_dir}"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "taking over the lock" in " ".join(result.stderr.split())
    assert not run_lock.lock_path(run_dir).exists()


def test_two_runs_started_together_do_not_both_win(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    held = run_lock.acquire(run_dir)
    with pytest.raises(run_lock.RunLockError, match="in use by another run"):
        run_lock.acquire(run_dir)
    run_lock.release(run_dir, held)
    assert not run_lock.lock_path(run_dir).exists()


def test_a_torchrun_job_shares_its_rank_0s_lock_and_a_restart_takes_it_over(tmp_path, monkeypatch) -> None:
    """The other ranks of the job see no conflict; a restart (same rendezvous id) takes the lock over even
    from another host; torchrun's default id "none" names no job, so it never takes over a live run's lock."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    held = run_lock.acquire(run_dir)
    assert run_lock.conflict(run_dir) is None  # rank 1 of job7 validating while rank 0 holds the lock
    moved = {**held, "host": "another-node"}  # rank 0 of the first attempt ran elsewhere
    run_lock.lock_path(run_dir).write_text(json.dumps(moved))
    taken = run_lock.acquire(run_dir)  # a restart of job7: silently its own
    assert run_lock.read(run_dir) == taken
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job8")
    assert "in use by another run" in run_lock.conflict(run_dir)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    run_lock.lock_path(run_dir).write_text(json.dumps({**taken, "torchrun_job": "none"}))
    assert run_lock.conflict(run_dir) is None  # not judged by the rule; rank 0's acquire decides
    with pytest.raises(run_lock.RunLockError, match="in use by another run"):
        run_lock.acquire(run_dir)


def test_config_that_names_code_is_refused_in_the_hydra_node_too(tmp_path) -> None:
    argv = ["+hydra.callbacks.x._target_=shutil.copy", "+hydra.callbacks.x._args_=[/etc/hostname,copied]"]
    result = run_cli([*TINY, "train.max_steps=3", *argv], tmp_path)
    assert result.returncode == 2, result.stderr
    assert "configs may not name code to import or call" in " ".join(result.stderr.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing ran: no copy, no run directory


@pytest.mark.parametrize(
    ("hydra_section", "key"),
    [
        ("  callbacks:\n    x:\n      _target_: shutil.copy\n      _args_: [/etc/hostname, copied]\n",
         "hydra.callbacks.x._target_"),
        ("  job_logging:\n    handlers:\n      x:\n        '()': shutil.copy\n", "hydra.job_logging.handlers.x.()"),
    ],
)  # fmt: skip
def test_a_config_files_hydra_section_cannot_run_code_either(tmp_path, hydra_section, key) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "evil.yaml").write_text("defaults: [_run_spec, _self_]\nhydra:\n" + hydra_section)
    result = run_cli(["--config-path", str(conf), "--config-name", "evil"], tmp_path)
    assert result.returncode == 2 and key in result.stderr, result.stderr
    assert not (tmp_path / "copied").exists()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run_dir="], "run_dir: run_dir is empty: give a directory"),
        (["name="], "name: '' cannot name a run directory"),
        (["name=a/b"], "name: 'a/b' cannot name a run directory"),
        (
            ["train.max_steps=99999999999999999999999999"],
            "train.max_steps: 99999999999999999999999999 does not fit in 64 bits",
        ),
        (["data=text", "data.path=файл.txt"], "must be quoted inside the override: 'data.path=\"файл.txt\"'"),
        (
            ["name=${oc.env:LAUNCHER_SURELY_UNSET}"],
            "the environment variable LAUNCHER_SURELY_UNSET is not set",
        ),
        (["launcher.nproc=2"], "Pick a multi-rank option: parallel=ddp, fsdp, tp"),
    ],
)
def test_input_that_used_to_slip_through_is_refused_with_a_fix(tmp_path, argv, expected) -> None:
    result = run_cli(argv, tmp_path)
    err = " ".join(result.stderr.split())
    assert result.returncode == 2 and expected in err, err
    assert "Traceback" not in err and "parallel=deepspeed" not in err
    assert list(tmp_path.iterdir()) == []
