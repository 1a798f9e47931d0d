"""Checkpoints under damage: a same-size overwrite, a full disk, an unfinished save, non-finite steps.

Real files, a real (tmpfs) filesystem that fills up, real runs of `train`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from processes import mount_tmpfs

from conftest import TINY, losses, run_cli, run_inline
from launcher.components import checkpoint
from launcher.components.checkpoint_files import content_problem, read_manifest, total_bytes

RUN = [*TINY, "checkpoint.every=5", "checkpoint.keep=3", "train.max_steps=15"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted 15-step run, the reference for every resume here."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    assert run_inline(RUN, run_dir) == 0
    return run_dir


def test_same_size_corruption_is_caught_and_the_previous_checkpoint_resumes(straight, tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert run_inline([*RUN, "train.stop_after=10"], run_dir) == 0
    model = run_dir / "checkpoints" / "step_10" / "model.pt"
    size = model.stat().st_size
    with open(model, "r+b") as handle:  # 4 KiB overwritten in the middle: the size does not change
        handle.seek(size // 2)
        handle.write(os.urandom(4096))
    assert model.stat().st_size == size
    assert checkpoint.problem(model.parent) is None  # the sizes alone cannot tell
    assert "model.pt does not match the XXH3-128 digest" in content_problem(model.parent)
    with pytest.warns(UserWarning, match=r"step_10: file model.pt does not match the XXH3-128 digest"):
        assert run_inline([*RUN, "resume=auto"], run_dir) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step_5") and summary["exit_reason"] == "completed"
    assert losses(run_dir) == losses(straight)  # steps 6-15 replayed exactly, one record per step


def test_the_manifest_holds_a_hash_of_every_file(straight) -> None:
    newest = checkpoint.good_checkpoints(straight)[0]
    files = read_manifest(newest)["files"]
    on_disk = {str(p.relative_to(newest)) for p in newest.rglob("*") if p.is_file() and p.name != "COMPLETE"}
    assert set(files) == on_disk and all(len(entry["xxh3_128"]) == 32 for entry in files.values())
    assert content_problem(newest) is None


def test_an_unfinished_save_is_reported_and_removed_at_start(tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert run_inline([*RUN, "train.stop_after=10"], run_dir) == 0
    partial = run_dir / "checkpoints" / ".partial_step_12"
    partial.mkdir()
    (partial / "model.pt").write_bytes(b"half a file")
    result = run_cli([*RUN, f"run_dir={run_dir}", "resume=auto"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "removed" in result.stdout and ".partial_step_12" in result.stdout
    assert not partial.exists()


def test_pruning_keeps_the_checkpoint_from_before_the_non_finite_steps(tmp_path) -> None:
    run_dir = tmp_path / "run"
    for step, skipped in ((10, 0), (20, 0), (30, 4), (40, 9)):
        checkpoint.save(
            run_dir,
            step,
            lambda f: (f.directory / "w.bin").write_bytes(b"w"),
            keep=2,
            info={"nonfinite_skips": skipped},
        )
    kept = [p.name for p in checkpoint.good_checkpoints(run_dir)]
    assert kept == ["step_40", "step_30", "step_20"]  # keep=2, plus step_20: the last one before the skips


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_says_why(
    straight, tmp_path, background
) -> None:
    one_checkpoint = total_bytes(checkpoint.good_checkpoints(straight)[0])
    disk = tmp_path / "disk"
    mount_tmpfs(disk, int(1.5 * one_checkpoint) + 256 * 1024)  # room for one checkpoint, not two
    try:
        run_dir = disk / "run"
        result = run_cli(
            [*RUN, "checkpoint.keep=1", f"checkpoint.async_save={background}", f"run_dir={run_dir}"], tmp_path
        )
        out = " ".join((result.stdout + result.stderr).split())
        assert result.returncode == 1, out[-3000:]
        assert "Traceback" not in out
        assert "warning: only" in out and "the next save may fail" in out  # said before the save
        assert "could not write the checkpoint of step 10" in out and "bytes are free there now" in out
        assert "The previous checkpoint" in out and "step_5 is intact" in out
        summary = json.loads((run_dir / "summary.json").read_text())
        # a background save's failure stops the run where the next save (here the final one) waits for it
        assert summary["exit_reason"] == "checkpoint_failed" and summary["steps"] == (
            15 if background else 10
        )
        assert [p.name for p in checkpoint.good_checkpoints(run_dir)] == ["step_5"]
        assert content_problem(run_dir / "checkpoints" / "step_5") is None
        assert not checkpoint.unfinished(run_dir)
        assert shutil.disk_usage(disk).free > one_checkpoint // 4  # the unfinished checkpoint was removed
    finally:
        subprocess.run(["umount", str(disk)], check=False)
