"""`checkpoint.keep_best` keeps the best checkpoint whatever `checkpoint.keep` prunes and `train-export --best`
writes it; `train.early_stop` ends a run with its own exit reason and a final checkpoint, and a resumed run
continues its patience count (it is part of the checkpointed loop state).

Real runs of the default GPT. The held-out loss falls as the tiny model trains, so with the mode `max` its
best value is the first evaluation's and every later evaluation is one without improvement: the best
checkpoint is the oldest (the one `keep` would prune) and early stopping's count is known in advance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import TINY, run_inline
from launcher.components import checkpoint
from launcher.components.metrics import read_metrics
from launcher.tools import export

WATCH = [
    "train.max_steps=40", "train.eval_every=2", "train.eval_batches=1", "train.log_every=2",
    "checkpoint.every=2", "checkpoint.keep=2", "checkpoint.async_save=false",
    "checkpoint.keep_best=eval_loss", "checkpoint.keep_best_mode=max",
    "train.early_stop.metric=eval_loss", "train.early_stop.mode=max", "train.early_stop.patience=3",
]  # fmt: skip
"""Evaluations at steps 2 (the best), 4, 6 and 8 (the third without improvement: the run stops after step 8)."""


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _eval_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "eval_loss" in r}


@pytest.fixture(scope="module")
def watched(tmp_path_factory) -> Path:
    """A run that keeps its best checkpoint and stops early."""
    run_dir = tmp_path_factory.mktemp("best") / "run"
    assert run_inline([*TINY, *WATCH], run_dir) == 0  # early stopping is a success: exit status 0
    return run_dir


def test_early_stop_ends_the_run_with_its_reason_and_a_final_checkpoint(watched: Path) -> None:
    summary = _summary(watched)
    assert summary["exit_reason"] == "early_stopped" and summary["steps"] == 8
    assert summary["early_stop"]["evaluations_without_improvement"] == 3
    losses = _eval_losses(watched)
    assert sorted(losses) == [2, 4, 6, 8] and losses[2] == max(losses.values())
    assert (watched / "checkpoints" / "latest").read_text().strip() == "step_8"


def test_the_best_checkpoint_survives_pruning_and_export_best_writes_it(
    watched: Path, tmp_path: Path
) -> None:
    base = watched / "checkpoints"
    # keep=2: step_4 was pruned, step_2 (the best) was not
    assert [p.name for p in checkpoint.good_checkpoints(watched)] == ["step_8", "step_6", "step_2"]
    assert (base / "best").read_text().strip() == "step_2"
    best = _summary(watched)["best_checkpoint"]
    assert best["step"] == 2 and best["value"] == _eval_losses(watched)[2] and best["mode"] == "max"
    manifest = json.loads((base / "step_8" / "COMPLETE").read_text())
    assert manifest["best"] == "step_2" and manifest["scores"] == {"eval_loss": _eval_losses(watched)[8]}
    out = tmp_path / "best.pt"
    assert export.main([str(watched), str(out), "--best"]) == 0
    written = torch.load(out, weights_only=True)
    saved = torch.load(base / "step_2" / "model.pt", weights_only=True)
    assert written.keys() == saved.keys() and all(torch.equal(written[k], saved[k]) for k in saved)


def test_a_resumed_run_continues_the_patience_count(watched: Path, tmp_path: Path) -> None:
    """From step 6 (two evaluations without improvement) the next one, at step 8, is the third: it stops there."""
    run_dir = tmp_path / "resumed"
    assert run_inline([*TINY, *WATCH, f"resume={watched / 'checkpoints' / 'step_6'}"], run_dir) == 0
    summary = _summary(run_dir)
    assert summary["exit_reason"] == "early_stopped" and summary["steps"] == 8, summary
    assert _eval_losses(run_dir) == {8: _eval_losses(watched)[8]}  # the same step 8, bitwise
    # another run's checkpoint: its best is not one of this run's, so keep_best starts over here
    assert (run_dir / "checkpoints" / "best").read_text().strip() == "step_8"


def test_export_best_without_a_best_checkpoint_is_refused(watched: Path, tmp_path: Path, capsys) -> None:
    plain = tmp_path / "plain"
    (plain / "checkpoints").mkdir(parents=True)
    (plain / "spec.yaml").write_text((watched / "spec.yaml").read_text())
    assert export.main([str(plain), str(tmp_path / "w.pt"), "--best"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "has no best checkpoint" in err and "checkpoint.keep_best=<metric>" in err, err
