"""Evaluators: what the loop runs on the model as trained, every few steps and after the last step.

An evaluator has a `name`, `metrics(spec)` (the record names it will produce, known before launch, so
rules such as keep_best can check a metric exists) and `run(parts, step)`: collective on every rank,
its work split over data-parallel ranks, the result the same on every rank. Benchmark evaluators name
their records `eval/<task>/<metric>` (launcher.config.eval); the held-out loss keeps `eval_loss`.

`build_evaluators(spec)` lists the spec's evaluators, each with its cadence; `Evaluators.run_due`
runs those due after a step and merges their records into one. `train-eval` runs the same set once.
To add an evaluator: a module in launcher/rank with a class satisfying `Evaluator`, its config under `eval.` in
launcher/config/eval.py, and a line in `build_evaluators`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from launcher.config.eval import LOSS_METRICS
from launcher.rank import evaluation
from launcher.rank.eval_generation import GenerationChecks
from launcher.rank.loop_parts import Components
from launcher.spec import RunSpec

__all__ = ["Evaluator", "Evaluators", "HeldOutLoss", "Scheduled", "build_evaluators"]


@runtime_checkable
class Evaluator(Protocol):
    """One kind of evaluation of the model as trained (held-out loss, benchmark tasks, generation checks)."""

    name: str
    """Short name, as in the `eval` group (loss, lm_eval, generation)."""

    def metrics(self, spec: RunSpec) -> set[str]:
        """The record names `run` produces for this spec, known before launch (no model needed)."""
        ...

    def run(self, parts: Components, step: int) -> dict[str, float]:
        """Evaluate at `step` (collective: every rank calls it); the same records on every rank."""
        ...


@dataclass(frozen=True, kw_only=True)
class Scheduled:
    """An evaluator and when the loop runs it."""

    evaluator: Evaluator
    every: int | None
    """Optimizer steps between runs; None: none between."""
    at_end: bool
    """Whether it also runs after the last step."""

    def due(self, step: int, *, last: bool) -> bool:
        """Whether it runs after `step` (`last`: the run's final step)."""
        return bool(self.every and step % self.every == 0) or (last and self.at_end)


class Evaluators:
    """The spec's evaluators with their cadence; the loop asks which are due after each step."""

    def __init__(self, items: list[Scheduled]) -> None:
        self.items = items

    def __bool__(self) -> bool:
        return bool(self.items)

    def metrics(self, spec: RunSpec) -> set[str]:
        """Every record name the evaluators produce."""
        return set().union(*(item.evaluator.metrics(spec) for item in self.items))

    def run_due(self, parts: Components, step: int, *, last: bool) -> dict[str, float]:
        """Run the evaluators due after `step` (every rank calls it); their records merged ({} if none ran)."""
        scores: dict[str, float] = {}
        for item in self.items:
            if item.due(step, last=last):
                scores.update(item.evaluator.run(parts, step))
        return scores

    def run_all(self, parts: Components, step: int) -> dict[str, float]:
        """Run every evaluator once (train-eval; every rank calls it)."""
        scores: dict[str, float] = {}
        for item in self.items:
            scores.update(item.evaluator.run(parts, step))
        return scores


class HeldOutLoss:
    """The `loss` evaluator: `eval_loss`, `eval_ppl` (and `eval_loss/<source>` per named source of a mixture)
    on the held-out sequences (launcher.rank.evaluation), records unchanged."""

    name = "loss"

    def metrics(self, spec: RunSpec) -> set[str]:
        """eval_loss and eval_ppl, and each named mixture source's eval_loss/<name>."""
        names = {source.name for source in spec.data.sources if source.name}
        return {*LOSS_METRICS, *(f"eval_loss/{name}" for name in names)}

    def run(self, parts: Components, step: int) -> dict[str, float]:
        """The held-out loss at `step` ({} for a source without held-out sequences)."""
        return evaluation.evaluate(parts, step)


def build_evaluators(spec: RunSpec) -> Evaluators:
    """The spec's evaluators: the held-out loss at train.eval_every, the benchmarks at eval.every (or the same
    steps), each also after the last step unless train.eval_at_end=false (the loss: train.evaluates_at_end)."""
    t, e = spec.train, spec.eval
    items = []
    if e.loss:
        items.append(Scheduled(evaluator=HeldOutLoss(), every=t.eval_every, at_end=t.evaluates_at_end()))
    benchmark = {"every": e.benchmark_every(t.eval_every), "at_end": t.eval_at_end is not False}
    if e.lm_eval.tasks:
        from launcher.rank.eval_harness import LmEvalEvaluator  # lm-eval: imported only when tasks are set

        items.append(Scheduled(evaluator=LmEvalEvaluator(e.lm_eval), **benchmark))
    if e.generation.prompts is not None:
        items.append(Scheduled(evaluator=GenerationChecks(), **benchmark))
    return Evaluators(items)
