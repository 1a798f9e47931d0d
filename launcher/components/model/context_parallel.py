"""Context parallel: each sequence split over the ranks of a `cp` group, attention over the gathered keys and values.

Load-balanced causal sharding (as Megatron and torchtitan do): a sequence of T tokens is cut into
2N chunks for N ranks, and rank r keeps chunks r and 2N-1-r, so every rank holds one early and one
late chunk and the causal attention work is the same on every rank. `shard_sequence` cuts a
rank's part out of a whole batch tensor, `merge_sequence` puts the ranks' parts (in rank order)
back in sequence order.

Attention: each block's keys and values are all-gathered over the group (`gather_sequence`, whose
backward sums the gradients over the group and keeps this rank's part: a reduce-scatter built from
an all-reduce, so it runs on gloo), put back in sequence order, and each local query chunk attends
to the keys up to its own end with a causal mask at its global offset. Packed documents stay
apart: the position ids are gathered once per forward, and the document of every key comes from
them, so a document crossing a chunk border is seen whole. Queries use their global positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "ContextGroup",
    "ContextLayout",
    "gather_sequence",
    "merge_sequence",
    "shard_batch",
    "shard_sequence",
]


def chunk_order(rank: int, size: int) -> tuple[int, int]:
    """The two chunks (of 2 x size) rank `rank` keeps: r and 2 size - 1 - r."""
    return rank, 2 * size - 1 - rank


def shard_sequence(tensor: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of `tensor` along `dim`: its two load-balanced chunks, concatenated."""
    chunks = tensor.chunk(2 * size, dim=dim)
    first, second = chunk_order(rank, size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def merge_sequence(parts: torch.Tensor, size: int, dim: int = 1) -> torch.Tensor:
    """The whole sequence from the ranks' parts concatenated in rank order along `dim` (shard_sequence's inverse)."""
    pieces = parts.chunk(2 * size, dim=dim)  # rank r's chunks sit at 2r and 2r+1
    ordered = [pieces[2 * r] for r in range(size)] + [pieces[2 * r + 1] for r in reversed(range(size))]
    return torch.cat(ordered, dim=dim)


def shard_batch(batch: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """This rank's part of every sequence of a batch (every rank of the group reads the same batch).

    Rows padded to their longest (data.packing=false) are padded on to a multiple of 2 x size first:
    token 0 with label -100 (never trained; causal attention keeps earlier tokens from seeing them).
    """
    seq = batch["input_ids"].shape[1]
    pad = -seq % (2 * size)
    fill = {"labels": -100}
    out = {}
    for key, tensor in batch.items():
        if tensor.dim() < 2 or tensor.shape[1] != seq:
            out[key] = tensor
            continue
        if pad and key == "position_ids":
            tensor = torch.cat(
                [tensor, tensor[:, -1:] + torch.arange(1, pad + 1, device=tensor.device)], dim=1
            )
        elif pad:
            tensor = F.pad(tensor, (0, pad), value=fill.get(key, 0))
        out[key] = shard_sequence(tensor, rank, size)
    return out


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 1 over a group; backward sums the gradients over the group and keeps this rank's part."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int
    ) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.size = group, rank, size
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter: reduce, then keep our slice
        return grad.chunk(ctx.size, dim=1)[ctx.rank], None, None, None


@torch.compiler.disable  # a collective inside a compiled block: run it eagerly
def gather_sequence(tensor: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
    """Every rank's part of `tensor` [B, T/size, ...] gathered into sequence order [B, T, ...] (autograd-correct)."""
    return merge_sequence(_GatherSequence.apply(tensor, group, rank, size), size)


@dataclass(frozen=True)
class ContextGroup:
    """The context-parallel group a model's attention gathers over, and this rank's place in it."""

    group: dist.ProcessGroup
    rank: int
    size: int

    def layout(self, position_ids: torch.Tensor) -> ContextLayout:
        """The attention layout of one forward, from this rank's position ids [B, T/size] (gathers them once)."""
        with torch.no_grad():
            whole = gather_sequence(position_ids, self.group, self.rank, self.size)
            starts = whole == 0
            starts[:, 0] = True  # a row starts a document
            documents = starts.cumsum(dim=1)
            packed = bool((documents[:, -1] > 1).any())  # one document per row needs the causal mask alone
        return ContextLayout(
            context=self, key_documents=documents if packed else None, seq_len=whole.shape[1]
        )


@dataclass(frozen=True)
class ContextLayout:
    """What every block's attention needs in one forward: the documents of the keys, and the masks built once."""

    context: ContextGroup
    key_documents: torch.Tensor | None
    """[B, T] document of each key, in sequence order (None: one document per row)."""
    seq_len: int
    """Tokens of the whole sequence."""
    masks: dict = field(default_factory=dict)
    """dtype -> each local chunk's additive mask [B or 1, 1, T / (2 size), keys up to the chunk's end]: built
    once per forward and shared by every block (each block's attention keeps a reference, not a copy)."""

    def _masks(self, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """Causal at each chunk's global offset, and inside each packed document."""
        if dtype not in self.masks:
            c = self.context
            chunk = self.seq_len // (2 * c.size)
            masks = []
            for number in chunk_order(c.rank, c.size):
                end = (number + 1) * chunk  # keys after the chunk's last query are never seen
                index = torch.arange(number * chunk, end, device=device)
                allowed = (index.unsqueeze(1) >= torch.arange(end, device=device).unsqueeze(0)).unsqueeze(0)
                if self.key_documents is not None:
                    keys = self.key_documents[:, :end]
                    allowed = allowed & (keys[:, number * chunk : end].unsqueeze(2) == keys.unsqueeze(1))
                mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
                masks.append(mask.masked_fill_(~allowed, float("-inf")).unsqueeze(1))
            self.masks[dtype] = masks
        return self.masks[dtype]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float) -> torch.Tensor:
        """Attention of this rank's sequence-major queries [B, T/size, H, D] over every rank's keys and values."""
        c = self.context
        keys, values = (gather_sequence(t, c.group, c.rank, c.size) for t in (k, v))
        chunk = q.shape[1] // 2
        outs = []
        for half, mask in enumerate(self._masks(q.dtype, q.device)):
            end = mask.shape[-1]
            qh, kh, vh = (
                t.transpose(1, 2)
                for t in (q[:, half * chunk : (half + 1) * chunk], keys[:, :end], values[:, :end])
            )
            y = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, dropout_p=dropout_p)
            outs.append(y.transpose(1, 2))
        return torch.cat(outs, dim=1)
