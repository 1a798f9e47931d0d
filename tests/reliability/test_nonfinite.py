"""Runs that go bad: a learning rate far too high, and hyper-parameters that are not numbers at all."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY, read_metrics, run_cli, run_inline
from launcher.components import checkpoint


def test_a_run_that_skips_most_steps_stops_with_exit_3_and_the_advice(tmp_path) -> None:
    """optimizer.lr=1e6: after the first update every step is non-finite. Within the skip count budget
    (max_nonfinite_skips=20) it would run on; the share budget stops it once more than half of the
    last 20 steps were skipped, and the summary says so, never "completed"."""
    run_dir = tmp_path / "run"
    args = [*TINY, "optimizer.lr=1e6", "train.max_steps=60", "checkpoint.every=5", "train.eval_every=null"]
    assert run_inline(args, run_dir) == 3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "nonfinite" and summary["steps"] < 60
    assert summary["nonfinite_skips"] > 10
    for path in checkpoint.good_checkpoints(run_dir):  # every checkpoint written holds finite weights
        state = torch.load(path / "model.pt", weights_only=True)
        assert all(torch.isfinite(t).all() for t in state.values())


def test_the_share_budget_is_explained(tmp_path) -> None:
    result = run_cli([*TINY, "optimizer.lr=1e6", "train.max_steps=60", "checkpoint.every=null",
                      f"run_dir={tmp_path / 'run'}"], tmp_path)  # fmt: skip
    out = " ".join(result.stdout.split())
    assert result.returncode == 3
    assert (
        "of the last 20 steps were skipped as non-finite, more than train.max_nonfinite_fraction=0.5" in out
    )
    assert "lower optimizer.lr" in out


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("optimizer.lr=1e400", "optimizer.lr"),
        ("optimizer.lr=inf", "optimizer.lr"),
        ("optimizer.weight_decay=nan", "optimizer.weight_decay"),
        ("precision.loss_scale_init=inf", "precision.loss_scale_init"),
        ("optimizer.betas=[0.9,inf]", "optimizer.betas[1]"),
    ],
)
def test_non_finite_hyper_parameters_are_refused_before_anything_starts(tmp_path, override, key) -> None:
    result = run_cli([*TINY, override], tmp_path)
    assert result.returncode == 2
    assert f"{key}: must be a finite number" in " ".join(result.stderr.split())
    assert list(tmp_path.iterdir()) == []


def test_metrics_stay_finite_when_nothing_goes_wrong(tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert run_inline([*TINY, "train.max_steps=5", "checkpoint.every=null"], run_dir) == 0
    assert all(r["session"] == 0 for r in read_metrics(run_dir / "metrics.jsonl"))
