"""Pruning never loses the last good checkpoint: it counts only checkpoints that verify.

Real runs of `train`, real files overwritten in place (the size unchanged, so only the SHA-256 tells).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from conftest import TINY, run_cli, run_inline
from launcher.components import checkpoint
from launcher.components.checkpoint_files import content_problem

RUN = [*TINY, "checkpoint.every=5", "train.eval_every=null"]


def _damage(step_dir: Path, name: str = "model.pt") -> None:
    """Overwrite bytes in the middle of a file (4 KiB, or a quarter of a small one); its size does not change."""
    path = step_dir / name
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.seek(size // 2)
        handle.write(os.urandom(min(4096, size // 4)))
    assert path.stat().st_size == size


def _names(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def _write(run_dir: Path, step: int, keep: int) -> None:
    checkpoint.save(run_dir, step, lambda f: f.save({"w": list(range(step))}, "model.pt"), keep=keep)


@pytest.fixture(scope="module")
def to_step_20(tmp_path_factory) -> Path:
    """A run to step 20 with a checkpoint every 5 steps, all four kept."""
    run_dir = tmp_path_factory.mktemp("twenty") / "run"
    assert run_inline([*RUN, "train.max_steps=20", "checkpoint.keep=4"], run_dir) == 0
    assert _names(checkpoint.good_checkpoints(run_dir)) == ["step_20", "step_15", "step_10", "step_5"]
    return run_dir


# keep=2 in the extended tier: keep=1 holds the same sessions at the edge (the last good checkpoint goes only once
# a newer one verifies).
@pytest.mark.parametrize("keep", [pytest.param(2, marks=pytest.mark.extended), 1])
def test_damaged_newer_checkpoints_never_cost_the_last_good_one(to_step_20, tmp_path, keep) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(to_step_20, run_dir)
    base = run_dir / "checkpoints"
    _damage(base / "step_15")
    _damage(base / "step_20")
    # A session that resumes and ends below the damaged steps: it used to keep those and remove its own.
    result = run_cli([*RUN, f"run_dir={run_dir}", "resume=auto", f"checkpoint.keep={keep}", "train.max_steps=25",
                      "train.stop_after=12"], tmp_path)  # fmt: skip
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 0, out[-3000:]
    assert f"resumed from {base / 'step_10'} at step 10" in out
    assert f"skipping checkpoint {base / 'step_20'}: file model.pt does not match the XXH3-128 digest" in out
    assert f"moved aside to {base / 'damaged' / 'step_15'}" in out
    assert _names(checkpoint.damaged(run_dir)) == ["step_15", "step_20"]
    kept = ["step_12", "step_10"][:keep]  # step_10 goes only once step_12, newer, verifies
    assert _names(checkpoint.good_checkpoints(run_dir)) == kept
    for gone in ("step_10", "step_5")[keep - 1 :]:
        assert f"removed checkpoint {base / gone} (checkpoint.keep={keep}; newer ones verify: " in out
    assert (base / "latest").read_text().strip() == "step_12"
    # A further resume=auto continues from the session's checkpoint, to the end (in this process).
    assert run_inline([*RUN, "resume=auto", f"checkpoint.keep={keep}", "train.max_steps=25"], run_dir) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step_12") and summary["exit_reason"] == "completed"
    assert _names(checkpoint.good_checkpoints(run_dir)) == ["step_25", "step_20"][:keep]
    assert all(content_problem(p) is None for p in checkpoint.good_checkpoints(run_dir))
    assert _names(checkpoint.damaged(run_dir)) == ["step_15", "step_20"]  # never deleted, never resumed


def test_pruning_sets_aside_what_does_not_verify_and_counts_only_what_does(tmp_path, caplog) -> None:
    run_dir = tmp_path / "run"
    for step in (5, 10, 15, 20):
        _write(run_dir, step, keep=4)
    checkpoint.start_session(run_dir)  # a new session: it trusts nothing it did not hash itself
    _damage(run_dir / "checkpoints" / "step_15")
    _damage(run_dir / "checkpoints" / "step_20")
    with caplog.at_level(logging.WARNING, logger=checkpoint.LOG.name):
        _write(run_dir, 25, keep=2)
    lines = [record.getMessage() for record in caplog.records]
    assert _names(checkpoint.good_checkpoints(run_dir)) == ["step_25", "step_10"]
    assert _names(checkpoint.damaged(run_dir)) == ["step_15", "step_20"]
    assert any(
        "step_20 is damaged (file model.pt does not match the XXH3-128 digest" in line for line in lines
    )
    assert [line for line in lines if line.startswith("removed")] == [
        f"removed checkpoint {run_dir / 'checkpoints' / 'step_5'} (checkpoint.keep=2; newer ones verify: "
        "step_25, step_10)"
    ]


def test_a_session_never_removes_its_own_newest_or_the_one_it_resumed_from_too_early(tmp_path) -> None:
    run_dir = tmp_path / "run"
    for step in (5, 10, 15, 20):
        _write(run_dir, step, keep=4)
    checkpoint.start_session(run_dir)
    checkpoint.resumed(run_dir, run_dir / "checkpoints" / "step_10", verified=True)  # resume=.../step_10
    _write(run_dir, 12, keep=1)
    # step_20 is the newest that verifies (keep=1); step_12 is this session's own, below it: both stay.
    assert _names(checkpoint.good_checkpoints(run_dir)) == ["step_20", "step_12"]
    checkpoint.start_session(run_dir)
    checkpoint.resumed(run_dir, run_dir / "checkpoints" / "step_20", verified=False)
    _damage(run_dir / "checkpoints" / "step_20")
    checkpoint.prune(run_dir, keep=1)  # the resumed-from one is damaged: set aside, step_12 counts
    assert _names(checkpoint.good_checkpoints(run_dir)) == ["step_12"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_12"


def test_when_every_checkpoint_is_damaged_the_run_stops_and_stays_stopped(to_step_20, tmp_path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(to_step_20, run_dir)
    for step_dir in checkpoint.good_checkpoints(run_dir):
        _damage(step_dir)
    resume = [*RUN, "train.max_steps=25", "resume=auto"]
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        assert run_inline(resume, run_dir) == 1
    assert json.loads((run_dir / "summary.json").read_text())["exit_reason"] == "resume_failed"
    assert _names(checkpoint.damaged(run_dir)) == ["step_10", "step_15", "step_20", "step_5"]
    assert not checkpoint.good_checkpoints(run_dir)
    assert run_inline(resume, run_dir) == 1  # set aside, they are still this run's: it does not start over
    assert not checkpoint.good_checkpoints(run_dir) and not (run_dir / "checkpoints" / "latest").exists()
