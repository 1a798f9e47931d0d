"""The loop's evaluation: token-mean loss and perplexity over the step-input source's held-out sequences."""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch

from launcher.components.data.interleave import HeldOut
from launcher.components.data.sequences import PackedSequences, val_batches
from launcher.components.precision import cast_weights, eval_dtype
from launcher.components.schedule_free import averaged_weights
from launcher.rank.loop_parts import Components


@runtime_checkable
class ScoresHeldOut(Protocol):
    """A step-input source that adds its own held-out scores to an evaluation (on-policy distillation: eval_kl)."""

    def held_out_scores(self, parts: Components) -> dict[str, float]:
        """Record keys measured on held-out data with the model as it is (collective: every rank calls it)."""
        ...


@torch.no_grad()
def held_out_sums(parts: Components, sequences: PackedSequences) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's summed token loss and token count over up to train.eval_batches held-out micro batches."""
    dist, device = parts.dist, parts.dist.device
    total = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    batches = val_batches(
        sequences,
        micro_batch_size=parts.batch.micro_batch_size,
        max_batches=parts.spec.train.eval_batches,
        rank=dist.dp_rank,
        world_size=dist.dp_size,
    )
    for batch in batches:
        if parts.local_batch is not None:
            batch = parts.local_batch(batch)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        loss_sum, n = parts.runner.eval_loss(batch, eval_dtype(parts.spec.precision))
        total += loss_sum
        count += n
    return total, count


@torch.no_grad()
def evaluate(parts: Components, step: int) -> dict[str, float]:
    """Token-mean loss and perplexity on the source's held-out sequences, under the eval precision (collective).

    Named parts (a mixture's sources) are evaluated each on their own (`eval_loss/<name>`); `eval_loss`
    is then their mean weighted by the parts' weights. A source without held-out sequences gives `{}`.
    A schedule-free optimizer's averaged weights are the ones evaluated (launcher.components.schedule_free).
    """
    held_out: tuple[HeldOut, ...] = parts.source.held_out
    if not held_out:
        return {}
    model = parts.strategy.model
    precision = parts.spec.precision
    with averaged_weights(parts.strategy.optimizer):  # schedule-free: evaluate the average x, not y
        model.eval()
        with cast_weights(model, eval_dtype(precision), enabled=precision.eval_cast):
            sums = [float(value) for part in held_out for value in held_out_sums(parts, part.sequences)]
        model.train()
    totals = parts.dist.data_sum(sums)
    losses = {part.name: totals[2 * i] / max(totals[2 * i + 1], 1.0) for i, part in enumerate(held_out)}
    if any(part.name for part in held_out):
        weight = sum(part.weight for part in held_out)
        loss = sum(part.weight * losses[part.name] for part in held_out) / weight
        per_source = {f"eval_loss/{name}": value for name, value in losses.items()}
    else:
        loss, per_source = losses[""], {}
    scores = {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_step": step, **per_source}
    if isinstance(parts.source, ScoresHeldOut):  # a source that also measures its own (on-policy: eval_kl)
        with averaged_weights(parts.strategy.optimizer):
            scores.update(parts.source.held_out_scores(parts))
    return scores
