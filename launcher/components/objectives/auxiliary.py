"""A model's own auxiliary losses (an MoE router's load balancing and z-loss) added to any objective's loss.

Modules that compute auxiliary losses in a training forward hand them over per row (sequence) with
`take_pending() -> Tensor [B] | None`, already weighted by their coefficients. `WithAuxiliary` wraps the
run's objective: each row's auxiliary loss counts once per trained token of the row (labels != -100), so
after the loop divides the step's summed loss by its trained tokens the step's loss is the objective's plus
the token-weighted mean of the rows' auxiliary losses, whichever way the rows are split over ranks and
micro batches. Held-out batches (`train=False`) report the objective's loss alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from launcher.components.objectives import DataSum, Objective

if TYPE_CHECKING:  # torch only on a rank
    import torch


class AuxiliarySource(Protocol):
    """A module whose training forward leaves weighted auxiliary losses per row."""

    def take_pending(self) -> torch.Tensor | None:
        """The last training forward's auxiliary losses per row [B], handed over once (None: none pending)."""
        ...


class WithAuxiliary:
    """The run's objective plus the auxiliary losses of `sources`, counted per trained token of each row."""

    def __init__(self, objective: Objective, sources: list[AuxiliarySource]) -> None:
        self.objective, self.sources = objective, sources
        self.counts_processed_tokens = objective.counts_processed_tokens

    def loss_sum(
        self, outputs: torch.Tensor, batch: dict[str, torch.Tensor], *, train: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the objective's summed loss + each row's auxiliary loss x its trained tokens, counted terms)."""
        loss_sum, counted = self.objective.loss_sum(outputs, batch, train=train)
        pending = [p for p in (source.take_pending() for source in self.sources) if p is not None]
        if train and pending:
            tokens = (batch["labels"] != -100).sum(-1).to(loss_sum.dtype)  # [B] trained tokens per row
            per_row = sum(p.to(loss_sum.device, loss_sum.dtype) for p in pending)
            loss_sum = loss_sum + (per_row * tokens).sum()
        return loss_sum, counted

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """The objective's count (trained tokens)."""
        return self.objective.count(batch)

    def metrics(self, data_sum: DataSum) -> dict[str, float]:
        """The objective's keys (the auxiliary losses' own are launcher.components.model.moe_balance's)."""
        return self.objective.metrics(data_sum)


def auxiliary_sources(model: object) -> list[AuxiliarySource]:
    """The modules of `model` that leave auxiliary losses (those with `take_pending`), in module order."""
    return [m for m in model.modules() if callable(getattr(m, "take_pending", None))]  # type: ignore[attr-defined]


def with_auxiliary(objective: Objective, model: object) -> Objective:
    """`objective`, wrapped to add the auxiliary losses of `model`'s modules where it has any."""
    sources = auxiliary_sources(model)
    return WithAuxiliary(objective, sources) if sources else objective
