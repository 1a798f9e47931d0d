"""Schema of atomic, verifiable checkpoints: write to a partial directory, mark complete last, rename, prune.

What the group builds at run time lives in launcher.components.checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

LATEST = "latest"
BEST = "best"
"""checkpoints/best: the step directory with the best value of checkpoint.keep_best (beside `latest`)."""
PARTIAL_PREFIX = ".partial_"
SPACE_MARGIN = 1.1
"""Warn before a save when the free space is below this many times the last checkpoint's size."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When checkpoints are written and how many are kept."""

    every: int | None = 100
    """Optimizer steps between checkpoints; null turns periodic checkpoints off."""
    keep: int = 2
    """Newest checkpoints that verify kept on disk (damaged ones are moved to checkpoints/damaged/)."""
    save_final: bool = True
    """Also checkpoint after the last step, so a finished run can be extended or exported."""
    verify: bool = True
    """Before resuming, re-read the checkpoint and compare every file's digest with its manifest (beside the load)."""
    keep_best: str | None = None
    """An evaluation metric (eval_loss, eval/generation/accuracy, ...): the checkpoint with its best value is kept
    whatever `keep` prunes, named by checkpoints/best, exported by `train-export --best`; null: none."""
    keep_best_mode: str = "auto"
    """min, max or auto (min for names with loss, ppl, perplexity, bits_per_byte or error; max otherwise)."""
    async_save: bool = True
    """Copy the state to host memory and write it in the background while training goes on; the
    commit (manifest, rename, latest, prune) follows once every rank has written (docs/reliability.md).
    Named async_save because `async` is a Python keyword."""
