"""The objective seam: what a runner asks for a micro batch's loss, given the model's outputs and the batch.

An objective returns the SUM of its per-token (or per-example) losses and how many it counted, so
that accumulation and data parallelism normalize by the count of the whole optimizer step, however
a batch is split. It receives the whole batch dict (labels, and whatever else its data carries, e.g.
a preference pair's chosen and rejected halves) and the outputs of the model being trained; state
it keeps between calls (a frozen teacher or reference model, running sums) is its own. Runners and
strategies know nothing of which objective they serve. `metrics` adds keys to a log step's record.

- `CrossEntropy`: summed token cross-entropy over labels != -100 (`launcher.components.model.loss.lm_loss`);
- `launcher.components.distill.Distiller`: cross-entropy mixed with a teacher's KD term;
- `launcher.components.preference.Preference`: dpo, simpo, orpo and kto over pairs (or kto rows).

`count` says how many terms a batch adds to its optimizer step (trained tokens, or pairs): the loop
divides the step's summed loss by that count over every micro batch and data-parallel rank.

A pipeline's last stage asks the objective too, with a batch holding `labels` only (the stages
exchange hidden states, not batches): objectives that need more are refused there by the rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # torch only on a rank
    import torch

DataSum = Callable[[list[float]], list[float]]
"""Sums plain numbers over data-parallel groups, each counted once (DistContext.data_sum)."""


def trained_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The trained tokens of a batch (labels != -100)."""
    return int((batch["labels"] != -100).sum())


class Objective(Protocol):
    """The loss of a micro batch, as a sum and the number of terms it counts."""

    counts_processed_tokens: bool
    """Whether the record's tokens_per_s counts every token the model processed (both sides of a pair, the
    prompts a teacher reads too) rather than the trained ones (labels != -100), which trained_tokens_per_s counts."""

    def loss_sum(
        self, outputs: torch.Tensor, batch: dict[str, torch.Tensor], *, train: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss in float32, counted terms) of `batch` given the model's `outputs` (call it under autocast).

        `train` is False on held-out batches: an objective may report a plainer loss there.
        """
        ...

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """The terms `batch` adds to its step's count (its trained tokens, or a preference batch's pairs)."""
        ...

    def metrics(self, data_sum: DataSum) -> dict[str, float]:
        """Keys for the log step's record since the last call (summed over ranks with `data_sum`); {} for none."""
        ...


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
