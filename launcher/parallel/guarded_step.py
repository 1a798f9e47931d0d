"""The guarded optimizer step the torch-native strategies share: unscale, clip, and step only when finite."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from launcher.parallel.strategy import StepResult


def guarded_step(
    params: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    *,
    max_grad_norm: float | None,
    loss_ok: torch.Tensor,
    clip: Callable[[list[torch.Tensor], float | None], torch.Tensor] | None = None,
) -> StepResult:
    """Unscale, clip, and step only if loss and gradients are finite; always clear the gradients.

    Fused optimizers skip a non-finite step on the device (the `found_inf` input GradScaler also
    uses), so nothing is read back to the host; other optimizers read one boolean, which costs
    nothing on a CPU. `clip(params, max_norm)`, where given, clips and returns the global norm instead.
    """
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in params if p.grad is not None]
    if clip is not None:  # a strategy whose norm spans more than this rank's mesh (pipeline stages)
        norm = clip(params, max_grad_norm)
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or math.inf, foreach=_foreach(params))
        if isinstance(norm, DTensor):  # sharded gradients: the global norm, the same on every rank
            norm = norm.full_tensor()
    grads_ok = torch.isfinite(norm)
    if scaler is not None:
        scaler.step(optimizer)  # skips by itself when it found inf/NaN gradients
        scaler.update()
        result = StepResult(norm, nonfinite=~loss_ok, overflow=loss_ok & ~grads_ok)
    else:
        ok = grads_ok & loss_ok
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.grad_scale, optimizer.found_inf = None, (~ok).to(torch.float32)
            optimizer.step()
            optimizer.found_inf = None
        elif bool(ok):
            optimizer.step()
        result = StepResult(norm, nonfinite=~ok, overflow=False)
    optimizer.zero_grad(set_to_none=True)
    return result


def _foreach(params: list[torch.Tensor]) -> bool | None:
    """Clipping's kernel choice: foreach for DTensor gradients (sharded: the norm is summed over shards
    in one op), else torch's own (foreach on CUDA; on the CPU, where foreach ops loop per tensor, the
    per-tensor path: the same norm bitwise, 0.39 instead of 0.60 ms for gpt_tiny's 35 gradients)."""
    return True if any(isinstance(p.grad, DTensor) for p in params) else None
