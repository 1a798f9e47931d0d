"""Schema of the prune group: gradual magnitude pruning (unstructured or 2:4) of the blocks' linear weights.

What the group builds at run time lives in launcher.components.prune.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("none", "magnitude", "2_4")
SCOPES = ("global", "per_layer")
MASK = "prune_mask"
"""Name of the mask buffer on each pruned linear layer (its state-dict key is `<layer>.prune_mask`)."""
GROUP_2_4 = 4
"""2:4 sparsity: of each 4 consecutive weights along the input dimension, 2 are kept."""


@dataclass(frozen=True, kw_only=True)
class PruneConfig:
    """Gradual magnitude pruning of the blocks' linear weights (docs/compression.md, Pruning)."""

    method: str = "none"
    """none, magnitude (unstructured: the smallest |w|) or 2_4 (semi-structured: 2 of every 4 along the input dimension)."""
    scope: str = "global"
    """magnitude: global (one threshold over all pruned layers) or per_layer (each layer reaches the sparsity)."""
    target_sparsity: float = 0.5
    """Final share of pruned weights in the pruned layers, in [0, 1); 2_4 fixes it at 0.5."""
    start_step: int = 0
    """Optimizer step at which the schedule starts (sparsity 0 there)."""
    end_step: int = 100
    """Optimizer step at which target_sparsity is reached; the masks hold from then on (<= train.max_steps)."""
    every: int = 10
    """Optimizer steps between mask updates from start_step to end_step."""
