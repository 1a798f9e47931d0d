"""The router's load-balancing loss of a Mixture-of-Experts model, added to the run's objective.

A model with experts whose config turns the loss on (a Hugging Face folder's config.json:
`output_router_logits: true`, weight `router_aux_loss_coef`) keeps each training forward's
load-balancing loss on itself (`router_aux_loss`, a mean over the micro batch's tokens, transformers'
own Switch/Mixtral form). `WithRouterLoss` wraps the run's objective: it adds
`coef * aux * count` to the micro batch's summed loss, so that the loop's division by the step's
count gives `mean loss + coef * aux` (each micro batch's aux weighted by its share of the step), which
is transformers' own `loss` with labels for one micro batch on one rank. The runners and strategies
are unchanged: they ask the objective, as for every run. Held-out batches report the objective's plain
loss. The record's `router_aux_loss` is the step's mean aux (unweighted), summed over data-parallel ranks.

Each rank balances over its own tokens, as transformers' Trainer does under data parallelism, so with the
loss on, data-parallel runs match one process only up to that difference (off, they match exactly).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from launcher.components.objectives import DataSum, Objective


class WithRouterLoss:
    """The run's objective plus `coef` times the model's router load-balancing loss on training batches."""

    def __init__(self, inner: Objective, model: nn.Module, coef: float) -> None:
        self.inner, self.model, self.coef = inner, model, coef
        self.counts_processed_tokens = inner.counts_processed_tokens
        self._sums: list[torch.Tensor] | None = None

    def loss_sum(
        self, outputs: Any, batch: dict[str, torch.Tensor], *, train: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The objective's (summed loss, count), plus coef * aux * count on a training batch."""
        # read first: a reference that is the policy with adapters off runs it again inside the objective
        aux, self.model.router_aux_loss = self.model.router_aux_loss, None
        total, count = self.inner.loss_sum(outputs, batch, train=train)
        if not train or aux is None:
            return total, count
        aux = aux.float()
        sums = [aux.detach(), torch.ones((), device=aux.device)]
        self._sums = sums if self._sums is None else [a + b for a, b in zip(self._sums, sums, strict=True)]
        return total + self.coef * aux * count, count

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """The objective's count."""
        return self.inner.count(batch)

    def metrics(self, data_sum: DataSum) -> dict[str, float]:
        """The objective's keys and router_aux_loss, the mean load-balancing loss of the interval's micro batches."""
        found = self.inner.metrics(data_sum)
        sums, self._sums = self._sums, None
        aux_sum, batches = data_sum([0.0, 0.0] if sums is None else [float(x) for x in sums])
        return {**found, "router_aux_loss": aux_sum / max(batches, 1.0)}


def with_router_loss(objective: Objective, model: nn.Module) -> Objective:
    """`objective` wrapped in WithRouterLoss where `model` weighs a router loss (router_aux_coef > 0), else itself."""
    coef = float(getattr(model, "router_aux_coef", 0.0) or 0.0)
    return WithRouterLoss(objective, model, coef) if coef else objective
