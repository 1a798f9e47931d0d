"""objective=sft: next-token cross-entropy summed over the trained tokens, the default objective.

It reads no frozen model. With distill.teacher set, `distillation` trains objective=sft instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launcher.components.objectives import DataSum, Frozen, FrozenModel, trained_tokens
from launcher.config.distill import DistillConfig
from launcher.config.objective import ObjectiveConfig

if TYPE_CHECKING:  # torch only on a rank
    import torch


class CrossEntropy:
    """Next-token cross-entropy summed over the trained tokens (labels != -100): the default objective."""

    counts_processed_tokens = False  # tokens_per_s: the trained tokens, as documented for every SFT run

    def loss_sum(
        self, outputs: torch.Tensor, batch: dict[str, torch.Tensor], *, train: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token cross-entropy, trained tokens)."""
        from launcher.components.model.loss import lm_loss

        return lm_loss(outputs, batch["labels"])

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Trained tokens (labels != -100) of a CPU batch: the step's loss is their mean."""
        return trained_tokens(batch)

    def metrics(self, data_sum: DataSum) -> dict[str, float]:
        """Nothing beyond the record's `loss`."""
        return {}


def frozen_model(objective: ObjectiveConfig, distill: DistillConfig, *, adapters: bool) -> FrozenModel | None:
    """None: cross-entropy compares with the labels alone."""
    return None


def build(objective: ObjectiveConfig, distill: DistillConfig, frozen: Frozen | None) -> CrossEntropy:
    """The cross-entropy objective (it has no settings)."""
    return CrossEntropy()
