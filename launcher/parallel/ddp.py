"""The `ddp` strategy: every rank holds the whole model; DistributedDataParallel averages gradients.

Gradients are all-reduced in buckets (parallel.bucket_mb) while backward still runs, skipped
inside `no_sync` (accumulation micro batches), and optionally compressed by a communication hook
(fp16 or bf16 casts, or PowerSGD low-rank approximation with error feedback). The replicas stay
identical, so rank 0 alone writes model, optimizer and scaler state; every rank loads it. PowerSGD
keeps per-rank state (error feedback, warm-started factors, its RNG), saved per rank.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from launcher.groups.adapters import checkpoint_state, load_checkpoint_state
from launcher.groups.checkpoint import load_tensor_file
from launcher.groups.checkpoint_files import CheckpointFiles
from launcher.groups.optimizer import build_optimizer
from launcher.groups.precision import make_grad_scaler
from launcher.parallel.guarded_step import guarded_step
from launcher.parallel.state_bytes import state_bytes
from launcher.parallel.strategy import Setup, StepResult, WholeModelVerbs

_POWERSGD_FIELDS = ("error_dict", "p_memory_dict", "q_memory_dict", "iter")


class DDPStrategy(WholeModelVerbs):
    """DistributedDataParallel over all ranks, with the single strategy's guarded step."""

    def __init__(self, model: nn.Module, setup: Setup) -> None:
        device, p = setup.dist.device, setup.spec.parallel
        self.rank = setup.dist.rank
        self.model = DistributedDataParallel(
            model.to(device),
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=p.bucket_mb,
            static_graph=p.static_graph,
            gradient_as_bucket_view=p.gradient_as_bucket_view,
            find_unused_parameters=p.find_unused_parameters,
        )
        self.powersgd = self._register_hook(p.comm_hook, p.powersgd_rank, p.powersgd_start_iter)
        self.optimizer = build_optimizer(self.model.module, setup.spec.optimizer, device.type)
        self.scaler = make_grad_scaler(setup.spec.precision, device.type)
        self.max_grad_norm = setup.spec.train.max_grad_norm

    def _register_hook(self, name: str, rank: int, start_iter: int) -> powerSGD_hook.PowerSGDState | None:
        """Install the gradient communication hook; returns PowerSGD's state (it is checkpointed)."""
        if name == "fp16":
            self.model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif name == "bf16":
            self.model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif name == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter
            )
            self.model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            return state
        return None

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate locally: no gradient all-reduce for this micro batch."""
        return self.model.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through the (fp16-scaled) loss; DDP all-reduces gradient buckets as they fill."""
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, *, loss_ok: torch.Tensor) -> StepResult:
        """Clip and step on the averaged gradients (identical on every rank), never with non-finite values."""
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
        """This rank's full replica of parameters, gradients and optimizer state."""
        return state_bytes(self.model.module, self.optimizer)

    def save(self, out: CheckpointFiles) -> None:
        """Rank 0 writes the replicated state once; PowerSGD state is written by every rank."""
        if self.rank == 0:
            out.save(checkpoint_state(self.model.module), "model.pt")
            out.save(self.optimizer.state_dict(), "optimizer.pt")
            if self.scaler is not None:
                out.save(self.scaler.state_dict(), "scaler.pt")
        if self.powersgd is not None:
            out.save(powersgd_state(self.powersgd), f"powersgd_rank{self.rank}.pt")

    def load(self, directory: Path) -> None:
        """Every rank loads rank 0's files (and its own PowerSGD state)."""
        load_checkpoint_state(self.model.module, load_tensor_file(directory / "model.pt"))
        self.optimizer.load_state_dict(load_tensor_file(directory / "optimizer.pt"))
        if self.scaler is not None:
            self.scaler.load_state_dict(load_tensor_file(directory / "scaler.pt"))
        if self.powersgd is not None:
            set_powersgd_state(self.powersgd, load_tensor_file(directory / f"powersgd_rank{self.rank}.pt"))

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state dict, as it loads into the unwrapped model."""
        return self.model.module.state_dict()


def powersgd_state(state: powerSGD_hook.PowerSGDState) -> dict[str, Any]:
    """PowerSGD's internal state in weights_only-loadable types (its RNG as tensors and ints)."""
    kind, key, pos, has_gauss, cached = state.rng.get_state()
    return {
        **{name: getattr(state, name) for name in _POWERSGD_FIELDS},
        "rng": [kind, torch.from_numpy(key.copy()), pos, has_gauss, cached],
    }


def set_powersgd_state(state: powerSGD_hook.PowerSGDState, saved: dict[str, Any]) -> None:
    """Restore what `powersgd_state` captured."""
    for name in _POWERSGD_FIELDS:
        setattr(state, name, saved[name])
    kind, key, pos, has_gauss, cached = saved["rng"]
    state.rng.set_state((kind, key.numpy(), pos, has_gauss, cached))


def build(model: nn.Module, setup: Setup) -> DDPStrategy:
    """Registry entry point."""
    return DDPStrategy(model, setup)


def consolidate(directory: Path) -> dict[str, torch.Tensor]:
    """The model state dict of a checkpoint written by this strategy (offline, one process): the full
    one, or with adapters only the trainable parameters (load it with adapters.load_checkpoint_state)."""
    return load_tensor_file(directory / "model.pt")
