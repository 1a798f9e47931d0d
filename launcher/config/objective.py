"""Schema of the objective group: what the loop minimises, cross-entropy (sft) or a preference loss.

What the group builds at run time lives in launcher.components.objectives (OBJECTIVES: a module per option).
"""

from __future__ import annotations

from dataclasses import dataclass

NAMES = ("sft", "dpo", "simpo", "orpo", "kto")
"""The objectives: supervised cross-entropy, and the four preference losses."""
DPO_LOSSES = ("sigmoid", "ipo")
"""objective.loss under dpo: the DPO paper's sigmoid loss, or IPO's squared loss."""
REFERENCES = ("model", "precompute")
"""Where the reference log-probs come from: a frozen reference model each step, or computed once before training."""
PAIRED = ("dpo", "simpo", "orpo")
"""Objectives trained on data.format=preference (a chosen and a rejected response per prompt)."""
NEEDS_REFERENCE = ("dpo", "kto")
"""Objectives that compare the policy with a reference model (simpo and orpo need none)."""


@dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    """The training objective: sft (cross-entropy) or a preference loss with its coefficients."""

    name: str = "sft"
    """sft (next-token cross-entropy), dpo, simpo, orpo (data.format=preference) or kto (data.format=kto)."""
    beta: float = 0.1
    """dpo/kto: scale of the log-ratio to the reference; simpo: reward scale; orpo: weight of the odds-ratio term (> 0)."""
    loss: str = "sigmoid"
    """dpo only: sigmoid (the DPO loss) or ipo (IPO's squared loss on length-averaged log-ratios)."""
    label_smoothing: float = 0.0
    """dpo and simpo: the assumed share of flipped labels in [0, 0.5) (conservative DPO)."""
    gamma: float = 0.5
    """simpo: the target reward margin gamma (the loss uses gamma / beta on the length-normalised log-probs)."""
    desirable_weight: float = 1.0
    """kto: weight of the desirable (label true) examples' loss."""
    undesirable_weight: float = 1.0
    """kto: weight of the undesirable (label false) examples' loss."""
    reference: str = "model"
    """dpo and kto: model (a reference forward each step; with LoRA the base with adapters off) or precompute (once, cached)."""


def rows_per_example(name: str) -> int:
    """Rows a micro batch holds per example: 2 for a pair (chosen and rejected) or a kto example (and its KL row), else 1."""
    return 2 if name in PAIRED or name == "kto" else 1
