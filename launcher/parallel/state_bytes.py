"""Per-rank memory of the training state (parameters, gradients, optimizer state), as sharded.

Sharded strategies hold DTensors: only the local shard counts on this rank, so FSDP2 full_shard
at N ranks reports about 1/N of one process. A tied matrix counts once. Every strategy reports
through its own `state_bytes()` (the Strategy protocol); the torch-native ones call `state_bytes`
here, DeepSpeed counts its flat ZeRO partitions itself.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch


def is_dtensor(tensor: object) -> bool:
    """Whether `tensor` is a DTensor, without importing torch.distributed.tensor (about 1 s) where none can exist."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for `tensor`: its local shard for a DTensor, the inner tensors of a tensor
    subclass that holds them (torchao's NF4Tensor: 4-bit codes and scales, not its nominal float32)."""
    if is_dtensor(tensor):
        tensor = tensor.to_local()
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None:
        return sum(local_bytes(getattr(tensor, name)) for name in flatten()[0])
    return tensor.numel() * tensor.element_size()


def _unique(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state tensors (moments, steps) on this rank."""
    return sum(
        local_bytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """param_bytes, grad_bytes (what gradients of the trainable parameters take once computed) and optimizer_bytes."""
    params = _unique(model.parameters())
    return {
        "param_bytes": sum(local_bytes(p) for p in params),
        "grad_bytes": sum(local_bytes(p) for p in params if p.requires_grad),
        "optimizer_bytes": optimizer_state_bytes(optimizer),
    }
