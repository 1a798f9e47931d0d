"""Attention over packed documents: a dense mask, per-document spans (varlen) or a FlexAttention block mask.

`model.attention` picks how a row that packs several documents keeps attention inside each one:

- sdpa: a dense [B, 1, T, T] boolean mask handed to SDPA (memory grows with T^2, and on a GPU a
  mask rules out the flash kernel);
- varlen: the rows are cut into their document spans and SDPA runs causal on each span
  (`is_causal=True`, no mask at all); it works on every device. torch's jagged nested tensors
  would batch the spans, but their SDPA refuses `is_causal=True` (torch 2.13), so spans it is;
- flex: a FlexAttention block mask built from the document ids (compiled once per shape); its
  backward runs on CUDA only in torch 2.13, so the rules refuse it for training elsewhere;
- auto: flex on CUDA and varlen elsewhere when documents are packed, plain causal SDPA when not.

A document starts at a position-0 token (and at the start of every row), as the packing collator
writes position ids. Every path gives the logits the dense mask gives.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from launcher.components.model.long_context import resolve_attention
from launcher.config.model import ATTENTION

__all__ = ["ATTENTION", "attend", "documents", "resolve_attention", "span_sizes", "varlen_attention"]


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] index of each token's document within its row (a position-0 token starts one)."""
    return (position_ids == 0).cumsum(dim=1)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] boolean mask: causal, and only within the document (the dense path)."""
    document = document_ids(position_ids)
    same = document.unsqueeze(2) == document.unsqueeze(1)
    seq = position_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal).unsqueeze(1)


def span_sizes(position_ids: torch.Tensor) -> list[int]:
    """Lengths of the document spans of all rows, row after row (they tile B * T): one host sync."""
    batch, seq = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    flat = torch.nonzero(starts.reshape(-1)).reshape(-1)
    bounds = torch.cat([flat, flat.new_tensor([batch * seq])])
    return (bounds[1:] - bounds[:-1]).tolist()


@torch.compiler.disable  # the spans change every batch: compiled blocks call it eagerly instead of recompiling
def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sizes: list[int], *, dropout_p: float = 0.0,
    scale: float | None = None, window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention on each document span of sequence-major q/k/v [B, T, H, D] -> [B, T, Hq, D].

    Keys and values may have fewer heads than queries (grouped-query attention). Splitting the
    flattened [B * T, H, D] tensors keeps every span contiguous, and their backward is one concat.
    Each span goes in as a batch of one ([1, H, t, D]): SDPA's CPU flash kernel takes only 4-D inputs,
    and a 3-D one falls back to the math path, which keeps the [H, t, t] attention weights for backward.

    `window` (a sliding-window layer: a query sees the `window` latest keys, itself included) masks
    spans longer than it; `softcap` (Gemma-2's attention logit softcapping, tanh(s / c) * c) has no
    SDPA kernel, so those spans run the explicit softmax transformers' eager path runs.
    """
    batch, seq, heads, dim = q.shape
    pieces = zip(*(t.reshape(batch * seq, t.shape[2], dim).split(sizes, 0) for t in (q, k, v)), strict=True)
    outs = [
        _span_attention(
            *(t.transpose(0, 1).unsqueeze(0) for t in span), dropout_p=dropout_p, scale=scale, window=window,
            softcap=softcap,
        ).squeeze(0).transpose(0, 1)
        for span in pieces
    ]  # fmt: skip
    return torch.cat(outs, 0).reshape(batch, seq, heads, dim)


def window_mask(size: int, window: int, device: torch.device) -> torch.Tensor:
    """[size, size] boolean mask: causal, and a query sees only keys fewer than `window` positions back."""
    index = torch.arange(size, device=device)
    distance = index.unsqueeze(1) - index.unsqueeze(0)
    return (distance >= 0) & (distance < window)


def _span_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float, scale: float | None,
    window: int | None, softcap: float | None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of one span, head-major [1, H, t, D]: SDPA, or the explicit softmax under a softcap."""
    size = q.shape[2]
    mask = window_mask(size, window, q.device) if window is not None and size > window else None
    gqa = k.shape[1] != q.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None, enable_gqa=gqa, scale=scale
        )
    if gqa:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    keep = mask if mask is not None else torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~keep, float("-inf"))
    weights = F.dropout(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), p=dropout_p)
    return torch.matmul(weights, v)


def flex_block_mask(position_ids: torch.Tensor) -> Any:
    """A FlexAttention BlockMask: causal within each packed document of each row."""
    from torch.nn.attention.flex_attention import create_block_mask

    document = document_ids(position_ids)

    def same_document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (document[b, q_idx] == document[b, kv_idx]) & (q_idx >= kv_idx)

    batch, seq = position_ids.shape
    # compiled on CUDA, so the mask is built block by block; eager (CPU forward checks) evaluates it densely
    return create_block_mask(
        same_document_causal, batch, None, seq, seq, device=position_ids.device, _compile=position_ids.is_cuda
    )


@functools.cache
def _compiled_flex() -> Any:
    """flex_attention compiled once (torch.compile caches one graph per shape bucket)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    """FlexAttention of head-major q/k/v [B, H, T, D]: compiled on CUDA, eager (forward checks) elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention as eager

    fn = _compiled_flex() if q.is_cuda else eager
    return fn(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


@dataclass(frozen=True)
class Documents:
    """How the blocks of one forward keep attention inside packed documents (built once per forward)."""

    path: str
    """sdpa (mask set, or None for plain causal), varlen (sizes set), flex (block_mask set) or cp (layout set)."""
    mask: torch.Tensor | None = None
    sizes: list[int] | None = None
    block_mask: Any = None
    layout: Any = None
    """Context parallel: the layout whose `attend` gathers keys and values over the group
    (launcher.components.model.context_parallel.ContextLayout)."""


def documents(
    choice: str, position_ids: torch.Tensor | None, device_type: str, *, dropout: float = 0.0
) -> Documents:
    """The layout `model.attention=choice` gives a batch with these position ids (None: not packed)."""
    path = resolve_attention(
        choice,
        packed=position_ids is not None,
        device_type=device_type,
        dropout=dropout,
        seq_len=None if position_ids is None else position_ids.shape[-1],
    )
    if position_ids is None:
        return Documents(path="sdpa")
    if path == "varlen":
        return Documents(path=path, sizes=span_sizes(position_ids))
    if path == "flex":
        return Documents(path=path, block_mask=flex_block_mask(position_ids))
    return Documents(path="sdpa", mask=document_mask(position_ids))


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, *, dropout_p: float
) -> torch.Tensor:
    """Attention of sequence-major q/k/v [B, T, H, D] -> [B, T, H, D] along the documents' path."""
    if docs.path == "cp":
        return docs.layout.attend(q, k, v, dropout_p=dropout_p)
    if docs.path == "varlen":
        return varlen_attention(q, k, v, docs.sizes, dropout_p=dropout_p)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if docs.path == "flex":
        y = flex_attention(q, k, v, docs.block_mask)
    else:
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=docs.mask, dropout_p=dropout_p, is_causal=docs.mask is None
        )
    return y.transpose(1, 2)
