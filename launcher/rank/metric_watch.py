"""What the loop does with evaluation results: keep the best checkpoint (checkpoint.keep_best) and stop early
(train.early_stop).

Every rank holds the same watch and feeds it the same scores (an evaluation's result is the same on
every rank), so every rank decides alike to stop, with no collective of its own. Its state (the best
value and step, the evaluations without improvement) is part of the loop state in trainer.pt, so a
resumed run continues the patience count and the best exactly. A metric measured at a step counts for
keep_best at the checkpoint of that same step: the rules (launcher.rules.best) refuse a spec whose
evaluations fall on steps without a checkpoint.
"""

from __future__ import annotations

from typing import Any

from launcher.components.checkpoint_best import KEY
from launcher.config.best import direction, improves
from launcher.spec import RunSpec

STATE = "metric_watch"
"""The key of the watch's state in trainer.pt (absent in checkpoints written before it existed)."""
EXIT_REASON = "early_stopped"
"""summary.json's exit_reason of a run train.early_stop ended (exit status 0)."""


class MetricWatch:
    """The best value of checkpoint.keep_best's metric and train.early_stop's count, fed after each evaluation."""

    def __init__(self, spec: RunSpec) -> None:
        ckpt, early = spec.checkpoint, spec.train.early_stop
        self.keep = ckpt.keep_best
        self.keep_how = direction(ckpt.keep_best, ckpt.keep_best_mode) if ckpt.keep_best else "min"
        self.early = early
        self.early_how = direction(early.metric, early.mode) if early.metric else "min"
        self.best: dict[str, Any] = {"value": None, "step": None}
        """keep_best: the best value so far and the step it was measured at."""
        self.early_best: float | None = None
        """early_stop: the best value so far (improvements beyond min_delta only)."""
        self.bad_evals = 0
        """early_stop: evaluations in a row without an improvement of more than min_delta."""
        self.stopped = False
        """Whether early stopping ended the run at the last evaluation."""
        self._scores: dict[int, dict[str, float]] = {}

    def observe(self, step: int, scores: dict[str, Any]) -> bool:
        """Feed one evaluation's records at `step`; whether train.early_stop stops the run after this step."""
        watched = {m for m in (self.keep, self.early.metric) if m}
        self._scores = {step: {m: float(scores[m]) for m in watched if m in scores}}
        if self.keep in scores and improves(float(scores[self.keep]), self.best["value"], self.keep_how):
            self.best = {"value": float(scores[self.keep]), "step": step}
        metric = self.early.metric
        if metric is None or metric not in scores:
            return False
        value = float(scores[metric])
        if improves(value, self.early_best, self.early_how, self.early.min_delta):
            self.early_best, self.bad_evals = value, 0
        else:
            self.bad_evals += 1
        self.stopped = self.bad_evals >= self.early.patience
        return self.stopped

    def manifest(self, step: int) -> dict[str, Any]:
        """What the checkpoint of `step` records: the best checkpoint of its line and the scores measured at `step`."""
        if self.keep is None:
            return {}
        best = self.best["step"]
        return {KEY: f"step_{best}" if best is not None else None, "scores": self._scores.get(step, {})}

    def state_dict(self) -> dict[str, Any]:
        """The watch's part of the loop state (trainer.pt)."""
        return {STATE: {"best": dict(self.best), "early_best": self.early_best, "bad_evals": self.bad_evals}}

    def load_state_dict(self, state: dict[str, Any], *, own: bool) -> None:
        """Continue from a checkpoint's loop state; `own` false (another run's checkpoint): its best step is not
        one of this run's checkpoints, so keep_best starts over (early stopping's count continues)."""
        saved = state.get(STATE)
        if saved is None:
            return
        if own:
            self.best = dict(saved["best"])
        self.early_best, self.bad_evals = saved["early_best"], int(saved["bad_evals"])

    def summary(self) -> dict[str, Any]:
        """summary.json's fields: the best checkpoint and its value, early stopping's count."""
        out: dict[str, Any] = {}
        if self.keep is not None:
            step = self.best["step"]
            out["best_checkpoint"] = {
                "metric": self.keep, "mode": self.keep_how, "value": self.best["value"],
                "step": step, "path": f"checkpoints/step_{step}" if step is not None else None,
            }  # fmt: skip
        if self.early.metric is not None:
            out["early_stop"] = {
                "metric": self.early.metric, "mode": self.early_how, "best": self.early_best,
                "evaluations_without_improvement": self.bad_evals, "patience": self.early.patience,
            }  # fmt: skip
        return out
