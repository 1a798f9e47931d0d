"""Cross-entropy over logits sharded along the vocabulary (tensor parallel's head), without gathering them.

Under tensor parallelism the head is split column-wise over the vocabulary
(launcher.parallel.tensor_parallel), so each rank holds a DTensor of its [B, T, vocab / tp] slice
of the logits. torch's `loss_parallel` computes the cross-entropy of such a tensor with two small
all-reduces per row block (the max and the sum of exponentials) and never builds the whole
[B, T, vocab] tensor; its backward must run inside the same context, so the loss is an autograd
function that enters it in forward and again in backward. The loss it returns is a plain tensor,
equal on every rank of the group: the loop, the optimizer step and the logs see no DTensor.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F


def is_vocab_sharded(logits: Any) -> bool:
    """True for a DTensor sharded along its last (vocabulary) dimension."""
    tensor_module = sys.modules.get("torch.distributed.tensor")  # imported by every tensor-parallel run
    if tensor_module is None or not isinstance(logits, tensor_module.DTensor):
        return False
    return any(p.is_shard(logits.ndim - 1) for p in logits.placements)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of vocabulary-sharded (rows, vocab) logits under torch's loss_parallel."""

    @staticmethod
    def forward(ctx: Any, logits: Any, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        with torch.enable_grad(), loss_parallel():
            leaf = logits.detach().requires_grad_(logits.requires_grad)
            loss = F.cross_entropy(leaf.float(), labels, ignore_index=ignore_index, reduction="sum")
        ctx.leaf, ctx.loss = leaf, loss
        return loss.to_local().detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None]:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            grad = DTensor.from_local(grad, ctx.loss.device_mesh, ctx.loss.placements, run_check=False)
            (logits_grad,) = torch.autograd.grad(ctx.loss, ctx.leaf, grad)
        ctx.leaf = ctx.loss = None
        return logits_grad, None, None


def vocab_parallel_cross_entropy(logits: Any, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Summed float32 cross-entropy of [..., vocab / tp] DTensor logits against plain [...] labels."""
    rows = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(rows, labels.reshape(-1), ignore_index)
