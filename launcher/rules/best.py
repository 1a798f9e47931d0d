"""Rules of what evaluations drive: `checkpoint.keep_best` and `train.early_stop` (launcher.rank.metric_watch).

The metric must be one an evaluation of this run produces (the list is shown); keep_best needs a
checkpoint at every step an evaluation measures the metric (as Hugging Face's Trainer asks saves and
evaluations to line up), and early stopping needs evaluations to count.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from launcher.components.data.mixture import resolve
from launcher.components.eval_tasks import planned_records
from launcher.config.eval import LOSS_METRICS, RECORD_PREFIX, lm_eval_record
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError, did_you_mean

NO_EVALUATION = "this run makes no evaluation (train.eval_every=null and no evaluation at the end), so no metric is measured"


def _benchmarks_run(spec: RunSpec) -> bool:
    """Whether the benchmark evaluators (lm_eval, generation) run at all: every eval.every steps, or at the end."""
    return bool(spec.eval.benchmark_every(spec.train.eval_every)) or spec.train.eval_at_end is not False


def produced(spec: RunSpec) -> list[str]:
    """The metric names this run's evaluations write (empty when it evaluates never), known before launch."""
    names = []
    if spec.eval.loss and spec.train.evaluates():
        names += [*LOSS_METRICS, *(f"eval_loss/{source.name}" for source in resolve(spec.data))]
    if _benchmarks_run(spec):
        names += _lm_eval_records(spec)
        names += spec.eval.generation.metrics()
    return names


def _lm_eval_records(spec: RunSpec) -> list[str]:
    """The lm-evaluation-harness tasks' records (from their YAMLs), else `eval/<task>/<metric>` for each task named
    where its folder does not read (the lm_eval rules say why)."""
    if not spec.eval.lm_eval.tasks:
        return []
    try:
        return sorted(planned_records(spec.eval.lm_eval))
    except Exception:  # lm-eval missing, a folder without tasks: launcher.rules.evaluation reports it
        return [lm_eval_record(task, "<metric>") for task in spec.eval.lm_eval.tasks]


def _is_produced(metric: str, names: list[str]) -> bool:
    """Whether `metric` is one of `names` (an lm_eval task's `eval/<task>/<metric>` by its task's prefix)."""
    prefixes = [name.removesuffix("<metric>") for name in names if name.endswith("/<metric>")]
    return metric in names or any(metric.startswith(p) and len(metric) > len(p) for p in prefixes)


def _every_key(metric: str) -> str:
    """The key setting how often `metric` is measured: eval.every for a benchmark's record, else train.eval_every."""
    return "eval.every" if metric.startswith(RECORD_PREFIX) else "train.eval_every"


def cadence(metric: str, spec: RunSpec) -> tuple[int | None, bool]:
    """The steps between measurements of `metric` and whether it is measured after the last step."""
    t = spec.train
    if metric.startswith(RECORD_PREFIX):  # a benchmark evaluator's record
        return spec.eval.benchmark_every(t.eval_every), t.eval_at_end is not False
    return t.eval_every, t.evaluates_at_end()


def _unknown(key: str, metric: str, spec: RunSpec) -> Iterator[SpecError]:
    """An error naming the metrics this run produces when `metric` is not one of them."""
    names = produced(spec)
    if _is_produced(metric, names):
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
    every, at_end = cadence(c.keep_best, spec)
    if c.every is None:
        yield SpecError(
            ("checkpoint.keep_best", "checkpoint.every"),
            "keeps the best of the checkpoints written at evaluations, but checkpoint.every=null writes none. Set "
            f"checkpoint.every to {_every_key(c.keep_best)} ({every}) or a divisor of it, or checkpoint.keep_best=null.",
        )
        return
    if every is not None and every % c.every:
        key = _every_key(c.keep_best)
        yield SpecError(
            ("checkpoint.keep_best", key, "checkpoint.every"),
            f"a metric counts only at a step with a checkpoint, and {c.keep_best} is measured every {every} steps "
            f"({key}), not a multiple of checkpoint.every={c.every}, so some evaluations would have none. Make "
            f"{key} a multiple of checkpoint.every (e.g. checkpoint.every={every}).",
        )
    if at_end and t.max_steps % c.every and not c.save_final:
        yield SpecError(
            ("checkpoint.keep_best", "checkpoint.save_final"),
            f"the run evaluates after its last step ({t.max_steps}), where checkpoint.save_final=false writes no "
            "checkpoint to keep. Set checkpoint.save_final=true, or train.eval_at_end=false.",
        )


def _early_stop(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    e = spec.train.early_stop
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
    if cadence(e.metric, spec)[0] is None and _is_produced(e.metric, produced(spec)):
        key = _every_key(e.metric)
        yield SpecError(
            ("train.early_stop.metric", key),
            f"early stopping counts evaluations, but {key}=null measures {e.metric} only at the end. Set "
            f"{key}=N (steps between evaluations), or train.early_stop.metric=null.",
        )


RULES: tuple[Rule, ...] = (_keep_best, _early_stop)
