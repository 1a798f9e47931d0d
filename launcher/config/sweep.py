"""Schema of a Bayesian sweep's objective: the summary.json number each Optuna trial reports.

The sweeper itself (trials, parallel jobs, sampler, direction, storage) is configured under
`hydra.sweeper.*` of Hydra's Optuna sweeper (launcher.front.optuna_sweep).
"""

from __future__ import annotations

from dataclasses import dataclass

METRICS = ("eval_loss", "eval_ppl", "final_loss", "median_tokens_per_s", "peak_mem_bytes", "wall_time_s")
"""The numbers of a run's summary.json a sweep can optimise."""


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """What an Optuna sweep (`train -m hydra/sweeper=optuna`) optimises; plain runs and grid sweeps ignore it."""

    metric: str = "eval_loss"
    """The summary.json number a trial reports to the study; hydra.sweeper.direction says minimize or maximize."""
