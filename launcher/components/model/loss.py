"""The training loss of every model: summed token cross-entropy, so callers normalize by a global count.

A model whose loss is chunked (`train.loss_chunks`, launcher.components.model.long_context) returns
`HeadOutputs` (its final hidden states and the head that projects them) instead of logits; the
loss then projects and scores one chunk of token rows at a time, each chunk recomputed in backward
(torch.utils.checkpoint), so no whole [B, T, vocab] logits tensor, float32 or not, is ever alive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F

from launcher.components.model.vocab_parallel import is_vocab_sharded, vocab_parallel_cross_entropy


class HeadOutputs(NamedTuple):
    """Final hidden states [B, T, d] and the head that turns them into logits, for a chunked loss.

    A tuple, so data-parallel wrappers find the hidden states among a model's outputs.
    """

    hidden: torch.Tensor
    head: Callable[[torch.Tensor], torch.Tensor]
    chunks: int


def _chunk_ce(head: Callable, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Summed float32 cross-entropy of one chunk of hidden rows."""
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=ignore_index, reduction="sum")


def head_chunks(outputs: HeadOutputs, *tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """(hidden rows, matching rows of each of `tensors`) per chunk of the flattened [B * T] tokens."""
    hidden = outputs.hidden.reshape(-1, outputs.hidden.shape[-1])
    size = -(-hidden.shape[0] // max(outputs.chunks, 1))
    flat = [t.reshape(hidden.shape[0], *t.shape[2:]) for t in tensors]
    for start in range(0, hidden.shape[0], size):
        yield (hidden[start : start + size], *(t[start : start + size] for t in flat))


def chunked_lm_loss(outputs: HeadOutputs, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Summed token cross-entropy, head projection and all, one recomputed chunk of rows at a time."""
    from torch.utils.checkpoint import checkpoint

    total = outputs.hidden.new_zeros((), dtype=torch.float32)
    for rows, row_labels in head_chunks(outputs, labels):
        total = total + checkpoint(
            _chunk_ce,
            outputs.head,
            rows,
            row_labels,
            ignore_index,
            use_reentrant=False,
            preserve_rng_state=False,
        )
    return total


def full_logits(outputs: torch.Tensor | HeadOutputs) -> torch.Tensor:
    """The whole logits of a model's outputs (projecting HeadOutputs' hidden states at once)."""
    return outputs.head(outputs.hidden) if isinstance(outputs, HeadOutputs) else outputs


def lm_loss(
    logits: torch.Tensor | HeadOutputs, labels: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed token cross-entropy in float32, number of counted tokens): callers divide by a global count.

    Returning the sum rather than the mean lets accumulation and data parallelism normalize by the
    tokens of the whole optimizer step, so that the loss does not depend on how a batch is split.
    Logits sharded over the vocabulary (tensor parallel's head) are scored shard by shard.
    """
    counted = (labels != ignore_index).sum()
    if isinstance(logits, HeadOutputs):
        return chunked_lm_loss(logits, labels, ignore_index), counted
    if is_vocab_sharded(logits):  # tensor parallel: each rank holds its vocabulary slice of the logits
        return vocab_parallel_cross_entropy(logits, labels, ignore_index), counted
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    return loss_sum, counted


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword arguments of a model call: input_ids, and position_ids when the batch packs documents."""
    return {key: batch[key] for key in ("input_ids", "position_ids") if key in batch}
