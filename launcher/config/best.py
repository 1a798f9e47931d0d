"""Schema of early stopping (`train.early_stop`) and what "better" means for an evaluation metric.

Shared by `checkpoint.keep_best` (launcher.config.checkpoint) and `train.early_stop`: a metric is any
record an evaluation writes (`eval_loss`, `eval_ppl`, `eval_loss/<source>`, `eval/<task>/<metric>`),
and a mode says whether lower or higher is better; `auto` reads it from the name. No torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MODES = ("auto", "min", "max")
"""How a metric improves: auto (from its name, `direction`), min (lower is better), max (higher is better)."""
FINISHED = ("completed", "early_stopped")
"""summary.json's exit reasons of a run that finished (exit status 0): a sweep's point or trial that counts."""
LOWER_IS_BETTER = ("loss", "ppl", "perplexity", "bits_per_byte", "error")
"""Words in a metric's name that make `auto` mean min (`eval_loss`, `word_perplexity`); any other name means max
(accuracy, pass@k, exact_match)."""


@dataclass(frozen=True, kw_only=True)
class EarlyStopConfig:
    """Stop the run once an evaluation metric has not improved for `patience` evaluations."""

    metric: str | None = None
    """The evaluation record to watch (eval_loss, eval/generation/accuracy, ...); null: never stop early."""
    patience: int = 3
    """Evaluations in a row without an improvement of more than min_delta after which the run stops."""
    min_delta: float = 0.0
    """The least change over the best value so far that counts as an improvement (0 or more)."""
    mode: str = "auto"
    """min (lower is better), max (higher is better) or auto (min for names with loss, ppl, perplexity,
    bits_per_byte or error; max otherwise)."""


def direction(metric: str, mode: str) -> str:
    """min or max: `mode` itself, or for auto what the metric's name says (LOWER_IS_BETTER)."""
    if mode != "auto":
        return mode
    name = metric.lower()
    return "min" if any(word in name for word in LOWER_IS_BETTER) else "max"


def improves(value: float, best: float | None, how: str, min_delta: float = 0.0) -> bool:
    """Whether `value` beats `best` by more than `min_delta` in direction `how` (a non-finite value never does)."""
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    return value < best - min_delta if how == "min" else value > best + min_delta
