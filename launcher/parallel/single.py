"""The `single` strategy: one rank holds the model, its gradients and the optimizer state."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from launcher.groups.adapters import checkpoint_state, load_checkpoint_state
from launcher.groups.checkpoint import load_tensor_file
from launcher.groups.checkpoint_files import CheckpointFiles
from launcher.groups.optimizer import build_optimizer
from launcher.groups.precision import make_grad_scaler
from launcher.parallel.guarded_step import guarded_step
from launcher.parallel.state_bytes import state_bytes
from launcher.parallel.strategy import Setup, StepResult, WholeModelVerbs


class SingleStrategy(WholeModelVerbs):
    """Plain PyTorch on one device: the reference every other strategy must match."""

    def __init__(self, model: nn.Module, setup: Setup) -> None:
        device = setup.dist.device
        self.model = model.to(device)
        self.optimizer = build_optimizer(self.model, setup.spec.optimizer, device.type)
        self.scaler = make_grad_scaler(setup.spec.precision, device.type)
        self.max_grad_norm = setup.spec.train.max_grad_norm

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Nothing to synchronize with one rank."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through the (fp16-scaled) loss."""
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, *, loss_ok: torch.Tensor) -> StepResult:
        """Clip and step, never with non-finite values."""
        return guarded_step(
            self.model.parameters(),
            self.optimizer,
            self.scaler,
            max_grad_norm=self.max_grad_norm,
            loss_ok=loss_ok,
        )

    def loss_scale(self) -> float | None:
        """The fp16 loss scale (reads it back from the device)."""
        return float(self.scaler.get_scale()) if self.scaler else None

    def state_bytes(self) -> dict[str, int]:
        """Parameters, gradients and optimizer state of the one replica."""
        return state_bytes(self.model, self.optimizer)

    def save(self, out: CheckpointFiles) -> None:
        """Model, optimizer and scaler state as three files."""
        out.save(checkpoint_state(self.model), "model.pt")
        out.save(self.optimizer.state_dict(), "optimizer.pt")
        if self.scaler is not None:
            out.save(self.scaler.state_dict(), "scaler.pt")

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote."""
        load_checkpoint_state(self.model, load_tensor_file(directory / "model.pt"))
        self.optimizer.load_state_dict(load_tensor_file(directory / "optimizer.pt"))
        if self.scaler is not None:
            self.scaler.load_state_dict(load_tensor_file(directory / "scaler.pt"))

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state dict, as it loads into the unwrapped model."""
        return self.model.state_dict()


def build(model: nn.Module, setup: Setup) -> SingleStrategy:
    """Registry entry point."""
    return SingleStrategy(model, setup)


def consolidate(directory: Path) -> dict[str, torch.Tensor]:
    """The model state dict of a checkpoint written by this strategy (offline, one process): the full
    one, or with adapters only the trainable parameters (load it with adapters.load_checkpoint_state)."""
    return load_tensor_file(directory / "model.pt")
