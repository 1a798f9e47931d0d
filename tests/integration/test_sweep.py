"""`train --multirun` on this machine: a run directory per point, the sweep table, skip and resume on re-run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from conftest import TINY, run_cli

SWEEP = ["--multirun", *TINY, "train.max_steps=4", "train.eval_every=2", "checkpoint.every=2"]


def test_sweep_points_summary_table_and_rerun(tmp_path) -> None:
    sweep_dir = tmp_path / "sweep"
    args = [*SWEEP, "optimizer.lr=1e-3,3e-4", f"hydra.sweep.dir={sweep_dir}"]
    first = run_cli(args, tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    for n in (0, 1):
        for name in ("spec.yaml", "summary.json", "sweep_point.json"):
            assert (sweep_dir / str(n) / name).is_file(), (n, name)
    table = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert [p["swept"] for p in table["points"]] == [["optimizer.lr=0.001"], ["optimizer.lr=0.0003"]]
    losses = {p["point"]: p["eval_loss"] for p in table["points"]}
    assert table["ranked_by"] == "eval_loss" and table["winner"]["point"] == min(losses, key=losses.get)
    assert f"winner (lowest eval loss): point {table['winner']['point']}" in first.stdout

    # Point 1 "was interrupted": no summary, checkpoints left. The re-run skips 0 and resumes 1.
    (sweep_dir / "1" / "summary.json").unlink()
    shutil.rmtree(sweep_dir / "1" / "checkpoints" / "step_4")
    again = run_cli(args, tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "sweep point 0: already completed" in again.stdout
    assert "sweep point 1: resuming from its newest checkpoint" in again.stdout
    summary = json.loads((sweep_dir / "1" / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["resumed_from"].endswith("step_2")

    status = subprocess.run(
        [sys.executable, "-m", "launcher.front.sweep_status", str(sweep_dir)], capture_output=True, text=True
    )
    assert status.returncode == 0 and "completed" in status.stdout, status.stdout + status.stderr


def test_rerun_with_other_settings_is_refused_not_mixed(tmp_path) -> None:
    sweep_dir = tmp_path / "sweep"
    first = run_cli(
        [*SWEEP, "train.max_steps=3", "optimizer.lr=1e-3", f"hydra.sweep.dir={sweep_dir}"], tmp_path
    )
    assert first.returncode == 0, first.stdout + first.stderr
    other = run_cli(
        [*SWEEP, "train.max_steps=3", "optimizer.lr=5e-3", f"hydra.sweep.dir={sweep_dir}"], tmp_path
    )
    assert other.returncode == 2, other.stdout + other.stderr
    assert "holds a run with other settings (optimizer.lr)" in " ".join(other.stderr.split())
