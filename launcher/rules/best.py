"""Rules of what evaluations drive: `checkpoint.keep_best` and `train.early_stop` (launcher.rank.metric_watch).

The metric must be one an evaluation of this run produces (the list is shown); keep_best needs a
checkpoint at every step an evaluation measures the metric (as Hugging Face's Trainer asks saves and
evaluations to line up), and early stopping needs evaluations to count.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from launcher.components.data.mixture import resolve
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError, did_you_mean

NO_EVALUATION = "this run makes no evaluation (train.eval_every=null and no evaluation at the end), so no metric is measured"


def produced(spec: RunSpec) -> list[str]:
    """The metric names this run's evaluations write (empty when it evaluates never), known before launch."""
    if not spec.train.evaluates():
        return []
    names = ["eval_loss", "eval_ppl"]
    names += [f"eval_loss/{source.name}" for source in resolve(spec.data)]
    return names


def _unknown(key: str, metric: str, spec: RunSpec) -> Iterator[SpecError]:
    """An error naming the metrics this run produces when `metric` is not one of them."""
    names = produced(spec)
    if metric in names:
        return
    if not names:
        yield SpecError(
            (key,), f"'{metric}' is never measured: {NO_EVALUATION}. Set train.eval_every=N, or {key}=null."
        )
        return
    yield SpecError(
        (key,),
        f"no evaluation of this run produces the metric '{metric}'.{did_you_mean(metric, names)} The metrics it "
        f"produces: {', '.join(names)}.",
    )


def _keep_best(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    c, t = spec.checkpoint, spec.train
    if c.keep_best is None:
        return
    yield from _unknown("checkpoint.keep_best", c.keep_best, spec)
    if c.every is None:
        yield SpecError(
            ("checkpoint.keep_best", "checkpoint.every"),
            "keeps the best of the checkpoints written at evaluations, but checkpoint.every=null writes none. Set "
            f"checkpoint.every to train.eval_every ({t.eval_every}) or a divisor of it, or checkpoint.keep_best=null.",
        )
        return
    if t.eval_every is not None and t.eval_every % c.every:
        yield SpecError(
            ("checkpoint.keep_best", "train.eval_every", "checkpoint.every"),
            f"a metric counts only at a step with a checkpoint, and train.eval_every={t.eval_every} is not a multiple "
            f"of checkpoint.every={c.every}, so some evaluations would have none. Make train.eval_every a multiple "
            f"of checkpoint.every (e.g. checkpoint.every={t.eval_every}).",
        )
    if t.evaluates_at_end() and t.max_steps % c.every and not c.save_final:
        yield SpecError(
            ("checkpoint.keep_best", "checkpoint.save_final"),
            f"the run evaluates after its last step ({t.max_steps}), where checkpoint.save_final=false writes no "
            "checkpoint to keep. Set checkpoint.save_final=true, or train.eval_at_end=false.",
        )


def _early_stop(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    e, t = spec.train.early_stop, spec.train
    if e.patience < 1:
        yield SpecError(
            ("train.early_stop.patience",),
            f"must be 1 or more, got {e.patience}: the evaluations in a row without improvement after which the "
            "run stops (3 stops after the third).",
        )
    if not (math.isfinite(e.min_delta) and e.min_delta >= 0):
        yield SpecError(
            ("train.early_stop.min_delta",),
            f"must be a finite number, 0 or more, got {e.min_delta}: the least change over the best value that "
            "counts as an improvement (0: any change in the metric's direction; train.early_stop.mode sets it).",
        )
    if e.metric is None:
        return
    yield from _unknown("train.early_stop.metric", e.metric, spec)
    if t.eval_every is None and t.evaluates():
        yield SpecError(
            ("train.early_stop.metric", "train.eval_every"),
            "early stopping counts evaluations, but train.eval_every=null evaluates only at the end. Set "
            "train.eval_every=N (steps between evaluations), or train.early_stop.metric=null.",
        )


RULES: tuple[Rule, ...] = (_keep_best, _early_stop)
