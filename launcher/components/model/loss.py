"""The training loss of every model: summed token cross-entropy, so callers normalize by a global count."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed token cross-entropy in float32, number of counted tokens): callers divide by a global count.

    Returning the sum rather than the mean lets accumulation and data parallelism normalize by the
    tokens of the whole optimizer step, so that the loss does not depend on how a batch is split.
    """
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    return loss_sum, (labels != ignore_index).sum()


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword arguments of a model call: input_ids, and position_ids when the batch packs documents."""
    return {key: batch[key] for key in ("input_ids", "position_ids") if key in batch}
