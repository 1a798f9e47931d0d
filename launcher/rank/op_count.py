"""Every aten operator of a step with its FLOPs and the bytes it reads and writes, for the per-operator roofline.

`OpCounter` is a dispatch mode: active around a step (of fake tensors in `dry_run=simulate`, or real
ones), it sees each operator after autograd and autocast, so the shapes and dtypes are those a GPU
run has (bf16 matmul inputs under autocast, the mixed-precision policy's casts, the optimizer's
float32 state). An operator on DTensors (tensor parallelism, FSDP2's sharded parameters in the
optimizer) is costed on this rank's local shards, which its kernel touches. Operators that launch
no kernel (views, aliases, collectives, which the roofline times from the collective log) are not
counted. Calls of one operator with the same shape class and cost are tallied together.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

MATMULS = ("mm", "addmm", "bmm", "baddbmm")
"""aten matmuls costed at the calibrated GEMM rate of their shape."""

ATTENTION_FORWARD = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
"""Fused attention kernels (SDPA's backends); their `_backward` twins are attention too."""

NO_KERNEL = ("_local_scalar_dense", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
             "set_", "lift_fresh", "detach", "_unsafe_view", "resize_", "record_stream")  # fmt: skip
"""Operators that launch no GPU kernel besides views and collectives."""


@dataclass(frozen=True, kw_only=True)
class OpTally:
    """Calls of one operator with one cost: what the roofline times."""

    name: str
    """The aten operator (mm, _fused_adamw_, native_layer_norm, ...)."""
    kind: str
    """matmul, attention_forward, attention_backward, norm or memory."""
    flops: float
    """FLOPs of one call (matmuls: 2MNK; attention: 4 x batch x heads x q x k x head_dim, halved if causal)."""
    num_bytes: int
    """Bytes one call reads and writes."""
    count: int
    """Calls per step."""
    shape: tuple[int, ...] = ()
    """(M, N, K) of a matmul (batched: M counts every batch's rows), (batch x heads, seq, head_dim) of attention."""
    layout: str = ""
    """A matmul's operand layout: n (row-major) or t (transposed) for A then B, as scripts/calibrate_roofline names it."""


def _local(x: Any) -> Any:
    """A DTensor's local shard (what this rank's kernel touches); anything else as it is."""
    local = getattr(x, "_local_tensor", None)
    return local if isinstance(x, torch.Tensor) and isinstance(local, torch.Tensor) else x


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _transposed(t: torch.Tensor) -> str:
    """t when the last two dimensions are stored column-major."""
    return "t" if t.dim() >= 2 and t.stride(-2) == 1 and t.size(-1) > 1 else "n"


def _matmul(name: str, args: tuple) -> tuple[float, tuple[int, ...], str]:
    """FLOPs, (M, N, K) and layout of a matmul call."""
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
    batch = a.shape[0] if a.dim() == 3 else 1
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    return 2.0 * batch * m * n * k, (batch * m, n, k), _transposed(a) + _transposed(b)


def _attention(func: Any, args: tuple, kwargs: dict) -> tuple[float, tuple[int, ...]]:
    """Forward FLOPs of a fused attention call, forward or backward (the roofline costs a backward as twice
    that), and its (batch x heads, query length, head_dim)."""
    named = {arg.name: value for arg, value in zip(func._schema.arguments, args, strict=False)} | kwargs
    q, k = named["query"], named["key"]
    heads_batch = math.prod(q.shape[:-2])
    # A mask in a simulated step is transformers' causal mask, built because its check for "causal
    # without a mask" cannot read fake tensors; a GPU run takes the causal kernel (packed documents: less).
    causal = 0.5 if named.get("is_causal") is True or named.get("attn_mask") is not None else 1.0
    flops = 4.0 * heads_batch * q.shape[-2] * k.shape[-2] * q.shape[-1] * causal
    return flops, (heads_batch, q.shape[-2], q.shape[-1])


def _kind(name: str) -> str:
    base = name.removesuffix("_backward")
    if name in MATMULS:
        return "matmul"
    if base in ATTENTION_FORWARD:
        return "attention_backward" if name.endswith("_backward") else "attention_forward"
    if "norm" in name:
        return "norm"
    return "memory"


def _bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Inputs read, outputs written that are new tensors, and mutated inputs written back."""
    inputs = _tensors((args, kwargs))
    seen = {id(t) for t in inputs}
    written = sum(t.nbytes for t in _tensors(out) if id(t) not in seen)
    mutated = 0
    unscaled = kwargs.get("grad_scale") is None  # a fused optimizer writes its grads only to unscale them
    for arg, value in zip(func._schema.arguments, args, strict=False):
        if arg.alias_info is not None and arg.alias_info.is_write and not (arg.name == "grads" and unscaled):
            mutated += sum(t.nbytes for t in _tensors(value))
    read = sum(t.nbytes for t in inputs)
    if func.__name__.split(".")[0] == "copy_":
        read -= args[0].nbytes  # the destination is only written
    return read + written + mutated


def _is_view(func: Any) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class OpCounter(TorchDispatchMode):
    """Tally every kernel-launching aten operator dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if func.namespace != "aten" or name in NO_KERNEL or _is_view(func):
            return out
        self._record(
            func, name, *tree_map(_local, (args, kwargs, out))
        )  # a DTensor op costs its local shards
        return out

    def _record(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        kind, flops, shape, layout = _kind(name), 0.0, (), ""
        if kind == "matmul":
            flops, shape, layout = _matmul(name, args)
        elif kind.startswith("attention"):
            flops, shape = _attention(func, args, kwargs)
        self.counts[(name, kind, flops, _bytes(func, args, kwargs, out), shape, layout)] += 1

    def tallies(self) -> tuple[OpTally, ...]:
        """What was counted, most expensive first (by FLOPs, then bytes)."""
        rows = [
            OpTally(
                name=name,
                kind=kind,
                flops=flops,
                num_bytes=num_bytes,
                count=count,
                shape=shape,
                layout=layout,
            )
            for (name, kind, flops, num_bytes, shape, layout), count in self.counts.items()
        ]
        return tuple(sorted(rows, key=lambda r: (-r.flops * r.count, -r.num_bytes * r.count, r.name)))
