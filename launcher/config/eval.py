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


GENERATION_TASK = "generation"
"""The generation checks' records: `eval/generation/accuracy` and `eval/generation/pass@K`."""
GENERATION_MATCHES = ("exact", "numeric", "math_verify", "regex")
"""How an extracted answer is compared with the reference (regex: the reference is a pattern matched whole)."""


@dataclass(frozen=True, kw_only=True)
class GenerationEvalConfig:
    """Generation checks: prompts with reference answers scored by verifiers (docs/eval.md, "Generation checks")."""

    prompts: str | None = None
    """A JSONL file, one object per line with a prompt and its reference answer; null: the evaluator is off."""
    prompt_field: str = "prompt"
    """The field of each line holding the prompt text."""
    answer_field: str = "answer"
    """The field holding the reference answer (a string or a number; for match=regex, the pattern)."""
    chat: bool = False
    """Render each prompt as a user turn through the tokenizer's chat template (with the generation prompt)."""
    extract: str = "none"
    """How the answer is taken from a completion: none (all of it), last_number, boxed, tag:NAME; a|b tries in order."""
    match: str = "exact"
    """How it is compared with the reference: exact, numeric (0.5 == 1/2), math_verify (needs math-verify), regex."""
    samples: int = 1
    """Completions per prompt (n of the pass@k estimator); more than 1 needs temperature > 0."""
    pass_at: tuple[int, ...] = ()
    """The k of each `pass@k` record (each at most samples), by the unbiased estimator of Chen et al. (2021)."""
    temperature: float = 0.0
    """0: greedy; above 0: sampled, each completion seeded by seed and its prompt and sample number."""
    top_p: float = 1.0
    """Sample from the smallest set of most likely tokens whose probability reaches top_p."""
    seed: int = 0
    """The sampling seed: the same prompts and seed give the same completions on any world size."""
    max_new_tokens: int = 64
    """Most tokens generated per completion (it also ends at the tokenizer's eos)."""
    batch_size: int = 8
    """Completions decoded together on each data-parallel rank."""
    limit: int | None = None
    """Score the file's first `limit` prompts only; null: all of them."""

    def metrics(self) -> list[str]:
        """The records this evaluator writes ([] when it is off)."""
        if self.prompts is None:
            return []
        ks = [f"pass@{k}" for k in self.pass_at]
        return [f"{RECORD_PREFIX}{GENERATION_TASK}/{name}" for name in ("accuracy", *ks)]


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
        return bool(self.lm_eval.tasks) or self.generation.prompts is not None


def lm_eval_record(task: str, metric: str) -> str:
    """The record name of one lm-evaluation-harness score: `eval/<task>/<metric>`."""
    return f"{RECORD_PREFIX}{task}/{metric}"
