"""Schema of the `eval` group: which evaluators run on the model as trained, and how often.

The held-out loss (`loss`) keeps its records and its cadence (`train.eval_every`, `train.eval_at_end`);
the benchmark evaluators (`lm_eval`, `generation`) run every `eval.every` steps (null: on the held-out
loss's steps) and after the last step. Each evaluator's records are named `eval/<task>/<metric>`.
What runs in a rank lives in launcher.rank.evaluators; `train-eval` runs the same after training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RECORD_PREFIX = "eval/"
"""Every benchmark evaluator's records: `eval/<task>/<metric>` (the held-out loss keeps `eval_loss`)."""
LOSS_METRICS = ("eval_loss", "eval_ppl")
"""The held-out loss evaluator's records (and `eval_loss/<source>` per source of a mixture)."""


@dataclass(frozen=True, kw_only=True)
class LmEvalConfig:
    """lm-evaluation-harness tasks run on the model as trained (docs/eval.md); local task YAMLs and data only."""

    tasks: tuple[str, ...] = ()
    """Task (or group) names to run; empty: the evaluator is off. Found in include_path and the harness's own."""
    include_path: str | None = None
    """A local folder of task YAMLs (searched recursively), each task's data in local files."""
    num_fewshot: int | None = None
    """Few-shot examples put before each question; null: each task's own setting (usually 0)."""
    limit: float | None = None
    """Documents per task: an integer count, or a fraction of the task below 1.0; null: all of them."""
    batch_size: int = 8
    """Requests per forward on each data-parallel rank (loglikelihood) or per generation batch."""
    max_gen_tokens: int = 256
    """Most new tokens of a generate_until request whose task sets no max_gen_toks."""


@dataclass(frozen=True, kw_only=True)
class GenerationEvalConfig:
    """Generation checks: prompts with reference answers scored by verifiers (docs/eval.md, "Generation checks")."""


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Evaluators run on the model as trained every `every` steps and after the last step (docs/eval.md)."""

    every: int | None = None
    """Optimizer steps between runs of the benchmark evaluators; null: the held-out loss's steps (train.eval_every)."""
    loss: bool = True
    """The held-out loss and perplexity (`eval_loss`, `eval_ppl`) at train.eval_every; false turns it off."""
    lm_eval: LmEvalConfig = field(default_factory=LmEvalConfig)
    """lm-evaluation-harness tasks (needs the `eval` extra: pip install 'torch-launcher[eval]')."""
    generation: GenerationEvalConfig = field(default_factory=GenerationEvalConfig)
    """Generation checks against reference answers."""

    def benchmark_every(self, eval_every: int | None) -> int | None:
        """The benchmark evaluators' cadence: `every`, else the held-out loss's `train.eval_every`."""
        return self.every if self.every is not None else eval_every

    def has_benchmarks(self) -> bool:
        """Whether any evaluator beyond the held-out loss is configured."""
        return bool(self.lm_eval.tasks)


def lm_eval_record(task: str, metric: str) -> str:
    """The record name of one lm-evaluation-harness score: `eval/<task>/<metric>`."""
    return f"{RECORD_PREFIX}{task}/{metric}"
