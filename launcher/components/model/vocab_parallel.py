"""Cross-entropy over logits sharded along the vocabulary (tensor parallel's head), without gathering them.

Under tensor parallelism the head is split column-wise over the vocabulary
(launcher.parallel.tensor_parallel), so each rank holds a DTensor of its [B, T, vocab / tp] slice
of the logits. The loss is computed on that local slice, as Megatron-LM's vocabulary-parallel
cross-entropy computes it, with two small all-reduces over the tensor-parallel group per micro
batch (the rows' maxima; then the sums of exponentials beside the target logits, one buffer):
a float32 copy of the slice is shifted by the row maxima, exponentiated and divided by the sums in
place, so a rank keeps one float32 slice (the softmax) from forward to backward and its backward
makes the gradient in that same slice (subtract 1 at the targets this rank holds, scale each row by
the incoming gradient). torch's `loss_parallel` kept the logits and float32 log-probabilities and
made three float32 slices in backward. The loss it returns is a plain float32 tensor, equal on every
rank of the group: the loop, the optimizer step and the logs see no DTensor; the logits' gradient is
a DTensor of the logits' layout and dtype.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist


def is_vocab_sharded(logits: Any) -> bool:
    """True for a DTensor sharded along its last (vocabulary) dimension."""
    tensor_module = sys.modules.get("torch.distributed.tensor")  # imported by every tensor-parallel run
    if tensor_module is None or not isinstance(logits, tensor_module.DTensor):
        return False
    return any(p.is_shard(logits.ndim - 1) for p in logits.placements)


def _vocab_group_and_start(logits: Any) -> tuple[Any, int]:
    """The process group the vocabulary is split over (the mesh dimension sharding it) and this rank's first id."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh_dim = next(i for i, p in enumerate(logits.placements) if p.is_shard(logits.ndim - 1))
    _, offset = compute_local_shape_and_global_offset(logits.shape, logits.device_mesh, logits.placements)
    return logits.device_mesh.get_group(mesh_dim), offset[-1]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed float32 cross-entropy of vocabulary-sharded [..., vocab] DTensor logits, on each rank's local slice."""

    @staticmethod
    def forward(ctx: Any, logits: Any, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        group, start = _vocab_group_and_start(logits)
        local = logits.to_local()
        probs = local.reshape(-1, local.shape[-1]).to(torch.float32, copy=True)  # the one float32 slice
        labels = labels.reshape(-1)
        row_max = probs.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        probs.sub_(row_max.unsqueeze(-1))
        # the targets in this rank's vocabulary range, and their column in its slice (0 elsewhere)
        here = (labels >= start) & (labels < start + probs.shape[-1])
        index = torch.where(here, labels - start, 0)
        target = probs.gather(1, index.unsqueeze(-1)).squeeze(-1) * here  # the target's shifted logit, or 0
        probs.exp_()
        sums = torch.stack([probs.sum(dim=-1), target])  # one all-reduce for both
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        probs.div_(sums[0].unsqueeze(-1))  # the softmax, which backward turns into the gradient
        counted = labels != ignore_index
        loss = ((sums[0].log() - sums[1]) * counted).sum()
        ctx.probs, ctx.index, ctx.here, ctx.counted = probs, index, here & counted, counted
        ctx.mesh, ctx.placements, ctx.global_shape = logits.device_mesh, logits.placements, logits.shape
        ctx.global_stride, ctx.local_shape, ctx.dtype = logits.stride(), local.shape, local.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None]:
        from torch.distributed.tensor import DTensor

        grad_local = ctx.probs
        rows = torch.arange(grad_local.shape[0], device=grad_local.device)
        grad_local.index_put_((rows, ctx.index), -ctx.here.to(grad_local.dtype), accumulate=True)
        grad_local.mul_((grad.to(grad_local.dtype) * ctx.counted).unsqueeze(-1))  # ignored rows get zero
        ctx.probs = ctx.index = ctx.here = ctx.counted = None
        grad_local = grad_local.to(ctx.dtype).view(ctx.local_shape)  # no copy when the logits are float32
        shape, stride = ctx.global_shape, ctx.global_stride
        grad_logits = DTensor.from_local(
            grad_local, ctx.mesh, ctx.placements, run_check=False, shape=shape, stride=stride
        )
        return grad_logits, None, None


def vocab_parallel_cross_entropy(logits: Any, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Summed float32 cross-entropy of [..., vocab / tp] DTensor logits against plain [...] labels."""
    return _VocabParallelCrossEntropy.apply(logits, labels, ignore_index)
