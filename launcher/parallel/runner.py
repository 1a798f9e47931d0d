"""What the loop calls for a micro batch's forward and backward: a runner over the model and the objective.

Without a pipeline, `ModelRunner` runs model(**inputs) -> objective -> the strategy's backward; with
one, launcher.parallel.pipeline.PipelineRunner runs the schedule over the stages (its last stage asks
the same objective). Runners know the objective, strategies do not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from launcher.components.model.loss import model_inputs
from launcher.components.precision import autocast

Batch = dict[str, torch.Tensor]
"""A micro batch on the device: input_ids, labels, and whatever else its data carries (position_ids, ...)."""

if TYPE_CHECKING:
    from launcher.components.metrics import PhaseTimer
    from launcher.components.objectives import Objective
    from launcher.parallel.strategy import Strategy


class Runner(Protocol):
    """Forward and backward of one micro batch, and the loss of a held-out batch."""

    def forward_backward(
        self, batch: Batch, normalizer: torch.Tensor | float, dtype: torch.dtype, timer: PhaseTimer
    ) -> torch.Tensor:
        """Forward and backward of one micro batch, its loss divided by `normalizer`; returns the summed loss."""
        ...

    def eval_loss(self, batch: Batch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, counted terms) of a held-out batch (the caller disables gradients)."""
        ...


class ModelRunner:
    """The whole model on every rank: token ids -> outputs -> the objective's loss -> the strategy's backward."""

    def __init__(self, strategy: Strategy, objective: Objective) -> None:
        self.strategy, self.objective = strategy, objective

    def forward_backward(
        self, batch: Batch, normalizer: torch.Tensor | float, dtype: torch.dtype, timer: PhaseTimer
    ) -> torch.Tensor:
        """Forward under autocast, backward of the objective's summed loss / `normalizer`; returns the summed loss."""
        timer.start("forward")
        with autocast(dtype, batch["input_ids"].device.type):
            outputs = self.strategy.model(**model_inputs(batch))
            loss_sum, _ = self.objective.loss_sum(outputs, batch)
            del outputs
        timer.start("backward")
        self.strategy.backward(loss_sum / normalizer)
        return loss_sum.detach()

    def eval_loss(self, batch: Batch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, counted terms) of a held-out batch, the objective's held-out form."""
        with autocast(dtype, batch["input_ids"].device.type):
            return self.objective.loss_sum(self.strategy.model(**model_inputs(batch)), batch, train=False)
