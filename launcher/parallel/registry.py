"""Strategies are peers behind one small registry, imported only when chosen (DeepSpeed is heavy)."""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from launcher.parallel.dims import DistContext
    from launcher.parallel.guarded_step import StepResult
    from launcher.spec import RunSpec

# strategy name -> "module:function" building it from (model, Setup)
STRATEGIES: dict[str, str] = {
    "single": "launcher.parallel.single:build",
    "ddp": "launcher.parallel.ddp:build",
    "deepspeed": "launcher.parallel.deepspeed:build",
    "fsdp": "launcher.parallel.fsdp:build",
    "tp": "launcher.parallel.tensor_parallel:build",
}


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What a strategy needs to wrap a model: the spec and where this rank sits."""

    spec: RunSpec
    dist: DistContext


class Strategy(Protocol):
    """The loop's verbs, adapted to one parallel backend. The loop never forks per strategy."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def no_sync(self) -> contextlib.AbstractContextManager: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self, *, max_grad_norm: float | None, loss_ok: torch.Tensor) -> StepResult: ...

    def loss_scale(self) -> float | None: ...

    def save(self, directory: Path) -> None: ...

    def load(self, directory: Path) -> None: ...

    def export_state_dict(self) -> dict[str, torch.Tensor] | None: ...


def build_strategy(model: nn.Module, setup: Setup) -> Strategy:
    """Wrap `model` with the strategy the spec names."""
    module_name, function = STRATEGIES[setup.spec.parallel.strategy].split(":")
    return getattr(importlib.import_module(module_name), function)(model, setup)
