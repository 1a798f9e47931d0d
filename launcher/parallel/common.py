"""Verbs shared by the torch-native strategies: the guarded optimizer step and state files."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class StepResult:
    """What happened at one optimizer step."""

    grad_norm: torch.Tensor
    """Global gradient norm before clipping (on the device; read it on log steps only)."""
    nonfinite: bool
    """The loss or the gradients were NaN/inf outside fp16 loss scaling; the weights were not touched."""
    overflow: bool
    """fp16 gradients overflowed; the loss scaler skipped the step and lowered its scale."""


def guarded_step(
    params: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    *,
    max_grad_norm: float | None,
    loss_ok: torch.Tensor,
) -> StepResult:
    """Unscale, clip, and step only if loss and gradients are finite; always clear the gradients.

    Reads one boolean back from the device per optimizer step: the price of never letting a NaN
    reach the weights (GradScaler pays the same for fp16).
    """
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or math.inf, foreach=True)
    grads_ok, loss_finite = torch.stack([torch.isfinite(norm), loss_ok]).tolist()
    if scaler is not None:
        scaler.step(optimizer)  # skips by itself when it found inf/NaN gradients
        scaler.update()
        result = StepResult(norm, nonfinite=not loss_finite, overflow=loss_finite and not grads_ok)
    else:
        if grads_ok and loss_finite:
            optimizer.step()
        result = StepResult(norm, nonfinite=not (grads_ok and loss_finite), overflow=False)
    optimizer.zero_grad(set_to_none=True)
    return result


def save_tensor_file(obj: object, path: Path) -> None:
    """torch.save to `path`; the checkpoint module makes the directory atomic."""
    torch.save(obj, path)


def load_tensor_file(path: Path) -> object:
    """torch.load with weights_only=True: checkpoints never execute code on load."""
    return torch.load(path, map_location="cpu", weights_only=True)
