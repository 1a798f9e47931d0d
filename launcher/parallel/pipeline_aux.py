"""A pipeline's auxiliary losses (MoE routers' load balancing and z-loss): each stage adds its own blocks'.

Only the last stage computes the objective, so the per-row auxiliary losses an earlier stage's blocks leave
(launcher.components.objectives.auxiliary) never reach it. Each stage adds its own instead, as torchtitan
and Megatron do: after a stage's training forward its blocks' per-row losses are weighted by each row's
trained tokens (as `WithAuxiliary` weights them), divided by the step's normalizer (and scaled like the
loss under fp16), and attached to the stage's output by an identity whose backward gives that sum the
gradient 1, so the stage's backward carries their gradients into its routers and its input. Each row's
trained tokens travel with the micro batch as a keyword argument (`TOKENS`, split by the schedule like the
inputs and handed to every stage), taken off before the stage's own forward. The weighted sums are added
over the pipeline group for the recorded loss, which is then one process's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from launcher.components.objectives.auxiliary import auxiliary_sources


class _Attach(torch.autograd.Function):
    """Identity on the stage's output; in backward the attached loss term gets the gradient 1."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(term)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (term,) = ctx.saved_tensors
        return grad, torch.ones_like(term)


TOKENS = "auxiliary_row_tokens"
"""The keyword argument carrying each row's trained tokens [B] to every stage."""


class StageAuxiliary:
    """Adds the auxiliary losses of each stage's blocks to the step's loss and gradients (see the module)."""

    def __init__(self, parts: list[nn.Module], scaler: Any) -> None:
        self.scaler = scaler
        self.sums: list[torch.Tensor] = []
        """This rank's weighted auxiliary sums of the step (one per stage forward)."""
        self._normalizer: torch.Tensor | float = 1.0
        for part in parts:
            self._wrap(part, auxiliary_sources(part))

    def begin(
        self, batch: dict[str, torch.Tensor], normalizer: torch.Tensor | float
    ) -> dict[str, torch.Tensor]:
        """A new pipeline step over `batch`; the keyword arguments that carry its rows' trained tokens."""
        self._normalizer, self.sums = normalizer, []
        return {TOKENS: (batch["labels"] != -100).sum(-1)}

    def total(self, group: dist.ProcessGroup | None, device: torch.device) -> torch.Tensor:
        """The step's weighted auxiliary sums of every stage (collective over the pipeline group)."""
        total = torch.stack(self.sums).sum() if self.sums else torch.zeros((), device=device)
        if group is not None:
            dist.all_reduce(total, group=group)
        return total

    def _wrap(self, part: nn.Module, sources: list[Any]) -> None:
        """Take the tokens off the part's keyword arguments; attach its pending auxiliary losses to its output."""
        forward = part.forward

        @functools.wraps(forward)
        def with_auxiliary(*args: object, **kwargs: Any) -> object:
            tokens = kwargs.pop(TOKENS, None)
            output = forward(*args, **kwargs)
            pending = [p for p in (source.take_pending() for source in sources) if p is not None]
            if not pending or tokens is None:  # a stage without experts, evaluation, no gradients
                return output
            weighted = (sum(pending) * tokens.to(pending[0].device, pending[0].dtype)).sum()
            self.sums.append(weighted.detach())
            term = weighted / self._normalizer
            return _Attach.apply(output, self.scaler.scale(term) if self.scaler is not None else term)

        part.forward = with_auxiliary
