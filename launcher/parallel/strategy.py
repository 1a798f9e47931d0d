"""The seam between the loop and a parallel backend: the Strategy protocol and what it is built from.

The loop drives every strategy through the same few verbs; a strategy adapts them to its backend
and never forks the loop. Each strategy module offers `build(model, setup)` and, for offline
tools (export, merge), `consolidate(directory)`: the `StrategyModule` protocol the registry hands out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from launcher.groups.model.loss import lm_loss, model_inputs
from launcher.groups.precision import autocast

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from launcher.groups.batch_split import BatchSplit
    from launcher.groups.checkpoint_files import CheckpointFiles
    from launcher.groups.distill import Distiller
    from launcher.groups.metrics import PhaseTimer
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
    """What a strategy needs to wrap a model: the spec, where this rank sits, the batch split, the mesh."""

    spec: RunSpec
    """The run's frozen spec."""
    dist: DistContext
    """This rank's place in the job (rank, device, parallel degrees)."""
    batch: BatchSplit
    """Micro batch and accumulation steps the loop runs (the micro-batch search may have chosen them)."""
    mesh: DeviceMesh | None = None
    """The run's device mesh, built once by the topology owner for strategies that shard with DTensors."""
    load_weights: Callable[[nn.Module], None] | None = None
    """Set when the model was built empty: fills the wrapped (sharded) model with its pretrained weights."""


class WholeModelVerbs:
    """forward_backward and eval_loss of a strategy whose `model` maps token ids to logits on every rank.

    Only the pipeline strategy differs: its stages pass hidden states between ranks.
    """

    model: nn.Module
    backward: Callable[[torch.Tensor], None]
    """Backward through the (loss-scaled) normalized loss: each strategy's own."""
    distiller: Distiller | None = None
    """Set by launcher.rank.build under distill.teacher: adds the teacher's KD term to the training loss."""

    def forward_backward(
        self,
        batch: dict[str, torch.Tensor],
        normalizer: torch.Tensor | float,
        dtype: torch.dtype,
        timer: PhaseTimer,
    ) -> torch.Tensor:
        """Forward under autocast, backward of the summed token loss / `normalizer`; returns the summed loss."""
        timer.start("forward")
        with autocast(dtype, batch["input_ids"].device.type):
            inputs = model_inputs(batch)
            logits = self.model(**inputs)
            token_loss_sum, _ = lm_loss(logits, batch["labels"])
            if self.distiller is not None:
                token_loss_sum = self.distiller.loss_sum(token_loss_sum, logits, inputs, batch["labels"])
            del logits
        timer.start("backward")
        self.backward(token_loss_sum / normalizer)
        return token_loss_sum.detach()

    def eval_loss(
        self, batch: dict[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token loss, counted tokens) of a held-out batch (the caller disables gradients)."""
        with autocast(dtype, batch["input_ids"].device.type):
            return lm_loss(self.model(**model_inputs(batch)), batch["labels"])


class Strategy(Protocol):
    """The loop's verbs, adapted to one parallel backend. The loop never forks per strategy."""

    model: nn.Module
    """The wrapped model the loop calls (token ids -> logits)."""
    optimizer: torch.optim.Optimizer
    """The optimizer over the parameters this strategy owns (the LR schedule steps it)."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate this micro batch's gradients without communicating them."""
        ...

    def forward_backward(
        self,
        batch: dict[str, torch.Tensor],
        normalizer: torch.Tensor | float,
        dtype: torch.dtype,
        timer: PhaseTimer,
    ) -> torch.Tensor:
        """Forward and backward of one micro batch, its loss divided by `normalizer`; returns the summed token loss."""
        ...

    def eval_loss(
        self, batch: dict[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token loss, counted tokens) of a held-out batch, without gradients."""
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
        """Write this rank's part of a checkpoint through `out` (every rank calls it; each file gets its SHA-256)."""
        ...

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote (every rank calls it)."""
        ...

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state dict as it loads into the unwrapped model (collective where sharded)."""
        ...


class StrategyModule(Protocol):
    """What each strategy module offers the registry."""

    def build(self, model: nn.Module, setup: Setup) -> Strategy:
        """Wrap `model` for data parallelism (tensor parallelism is applied before) and build the optimizer."""
        ...

    def consolidate(self, directory: Path) -> dict[str, torch.Tensor]:
        """The full model state dict of a checkpoint this strategy wrote, offline in one process."""
        ...
