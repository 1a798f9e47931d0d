"""The seam between the loop and a parallel backend: the Strategy protocol and what it is built from.

The loop asks a runner (launcher.parallel.runner: the whole model, or the pipeline's schedule) for a
micro batch's forward and backward, and the strategy for the rest: no_sync, step, save, load. A
strategy holds the optimizer over this rank's model parts (the whole model, or its pipeline stages)
and knows nothing about objectives. Each strategy module offers `build(parts, setup)` and, for
offline tools (export, merge), `consolidate(directory)`: the `StrategyModule` protocol the registry
hands out.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from launcher.components.batch_split import BatchSplit
    from launcher.components.checkpoint_files import CheckpointFiles
    from launcher.parallel.dims import DistContext
    from launcher.spec import RunSpec


@dataclass(frozen=True)
class StepResult:
    """What happened at one optimizer step; flags may stay on the device until a log step reads them."""

    grad_norm: torch.Tensor
    """Global gradient norm before clipping (on the device; read it on log steps only)."""
    nonfinite: torch.Tensor | bool
    """The loss or the gradients were NaN/inf outside fp16 loss scaling; the weights were not touched."""
    overflow: torch.Tensor | bool
    """fp16 gradients overflowed; the loss scaler skipped the step and lowered its scale."""


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What a strategy needs over its model parts: the spec, where this rank sits, the batch split, the dtype, the mesh."""

    spec: RunSpec
    """The run's frozen spec."""
    dist: DistContext
    """This rank's place in the job (rank, device, parallel degrees)."""
    batch: BatchSplit
    """Micro batch and accumulation steps the loop runs (the micro-batch search may have chosen them)."""
    dtype: torch.dtype
    """The training steps' autocast dtype (launcher.rank.build decides it once; float32: no autocast)."""
    mesh: DeviceMesh | None = None
    """The run's one device mesh (launcher.parallel.dims), where the run has one."""


class Strategy(Protocol):
    """The loop's verbs over this rank's model parts, adapted to one parallel backend. The loop never forks."""

    model: nn.Module
    """The wrapped model the loop evaluates and checks (the whole model, or a ModuleList of this rank's stages)."""
    optimizer: torch.optim.Optimizer
    """The optimizer over the parameters this strategy owns (the LR schedule steps it)."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate this micro batch's gradients without communicating them."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through `loss` (already normalized), loss-scaled where fp16 asks."""
        ...

    def step(self, *, loss_ok: torch.Tensor) -> StepResult:
        """Clip to train.max_grad_norm and step, never with non-finite values; clear the gradients."""
        ...

    def loss_scale(self) -> float | None:
        """The fp16 loss scale (a device read), None without loss scaling."""
        ...

    def state_bytes(self) -> dict[str, int]:
        """This rank's param_bytes, grad_bytes and optimizer_bytes, as the strategy shards them."""
        ...

    def save(self, out: CheckpointFiles) -> None:
        """Write this rank's part of a checkpoint through `out` (every rank calls it; each file gets its digest)."""
        ...

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote (every rank calls it)."""
        ...

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state dict as it loads into the unwrapped model (collective where sharded)."""
        ...


class StrategyModule(Protocol):
    """What each strategy module offers the registry."""

    def build(self, parts: list[nn.Module], setup: Setup) -> Strategy:
        """The strategy over this rank's model parts (launcher.parallel.parallelize wrapped them) and its optimizer."""
        ...

    def consolidate(self, directory: Path) -> dict[str, torch.Tensor]:
        """The full model state dict of a checkpoint this strategy wrote, offline in one process."""
        ...
