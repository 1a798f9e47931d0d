"""What a fake tensor answers where code reads values: `dry_run=simulate`'s dispatch mode (launcher.rank.simulate).

Fake tensors have shapes but no values. A host read (`.item()`, `bool()`) of one answers 1, that is
true (the guarded step steps). A Mixture-of-Experts model's routing has data-dependent shapes
(`nonzero`, indexing by a boolean mask, `bincount` of the tokens per expert, read on the host by the
expert-parallel dispatch): they get the answers of dropless, balanced routing. Real tensors (a device
mesh's rank arithmetic, an optimizer's step count) stay real.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _all_true(mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The indices of a boolean mask whose every element is true (one [numel] tensor per dim; fake)."""
    return tuple(torch.empty(mask.numel(), dtype=torch.long, device=mask.device) for _ in range(mask.dim()))


def _balanced_counts(ids: torch.Tensor, bins: int) -> torch.Tensor:
    """A bincount of `ids` with its numel spread evenly over `bins` (real: routing counts read on the host)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    base, extra = divmod(ids.numel(), bins)
    with unset_fake_temporarily():
        return torch.tensor([base + (i < extra) for i in range(bins)], dtype=torch.long, device=ids.device)


class FakeScalars(TorchDispatchMode):
    """Answer host reads of fake values with 1 (true: the guarded step steps) and keep real tensors real.

    Routing's data-dependent shapes get the answers of dropless, balanced routing: a boolean mask is all
    true (`nonzero`, indexing by it: every assignment kept) and a `bincount` (tokens per expert) spreads its
    entries evenly over `minlength` bins, as real counts the expert computation can split rows by. A float32
    grouped GEMM (transformers' experts on the CPU) gets its shapes from a bf16 one: its meta kernel refuses
    float32.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        kwargs = kwargs or {}
        tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return True if args[0].dtype is torch.bool else (1.0 if args[0].is_floating_point() else 1)
        if any(isinstance(t, FakeTensor) for t in tensors):
            answer = _routing_answer(func, args, kwargs)
            if answer is not None:
                return answer
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():  # a device mesh's rank arithmetic, an optimizer's step count
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _routing_answer(func: Any, args: tuple, kwargs: dict) -> Any:
    """The dropless, balanced answer of a data-dependent op on fake tensors (None: not such an op)."""
    aten = torch.ops.aten
    if func is aten.nonzero.default:
        return torch.stack(_all_true(args[0]), dim=1) if args[0].dim() else args[0].new_zeros((1, 0)).long()
    if func is aten.bincount.default and kwargs.get("weights", args[1] if len(args) > 1 else None) is None:
        minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
        return _balanced_counts(args[0], max(int(minlength), 1))
    if func is aten._grouped_mm.default and args[0].dtype is not torch.bfloat16:
        # its meta kernel takes bf16 only where the CPU kernel takes float32 too: the shapes of a bf16 call
        cast = [
            a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
        ]
        return func(*cast, **kwargs).to(args[0].dtype)
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        masks = [index is not None and index.dtype is torch.bool for index in args[1]]
        if any(masks):
            indices = [
                part
                for index, mask in zip(args[1], masks, strict=True)
                for part in (_all_true(index) if mask else (index,))
            ]
            return func(args[0], indices, *args[2:], **kwargs)
    return None
