"""The one Strategy implementation of the torch-native strategies, over a rank's model parts.

A rank's parts are the whole model, or its pipeline stages; launcher.parallel.parallelize has
already applied tensor parallelism, checkpointing, compile and the data-parallel wrap (FSDP2, DDP or
none) to each. What differs between single, ddp, fsdp, tp and the pipelines is parameterised here,
not copied:

- no_sync: DDP's, FSDP2's deferred reduce-scatter, or nothing (one rank, tensor parallel alone, or
  a pipeline, whose schedule drives the stages' sync at its last micro batch);
- loss scaling (fp16): a plain GradScaler for one replicated model; the sharded scaler, whose
  overflow flag is all-reduced over every rank, for DTensors and pipelines (only the last stage
  scales a loss, so every rank starts its scale alike);
- clipping: the global norm over every part (DTensor norms full_tensor()'d); under a pipeline each
  stage's squared norm is summed over the pipeline group, the tied embedding and head counted once
  (their gradients are summed first, launcher.parallel.pipeline_stage.TiedCopies);
- checkpoints: launcher.parallel.part_state's layouts (files, dcp, stages);
- expert parallel: the expert slices' gradients reduced over their replicas (DDP; FSDP2 reduce-scatters
  them itself), every expert counted once in the norm, whole experts in the checkpoint
  (launcher.parallel.expert_parallel).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from launcher.components.checkpoint import load_tensor_file
from launcher.components.checkpoint_files import CheckpointFiles
from launcher.components.optimizer import build_optimizer
from launcher.components.precision import make_grad_scaler
from launcher.config.optimizer import OptimizerConfig
from launcher.config.precision import PrecisionConfig
from launcher.parallel import ddp
from launcher.parallel.guarded_step import guarded_step
from launcher.parallel.parallelize import data_parallel_wrap
from launcher.parallel.part_state import PartState
from launcher.parallel.part_state import consolidate as consolidate
from launcher.parallel.pipeline_stage import TiedCopies, local_tensor, tied_pair
from launcher.parallel.registry import STRATEGIES
from launcher.parallel.state_bytes import state_bytes
from launcher.parallel.strategy import Setup, StepResult

__all__ = ["PartsStrategy", "build", "consolidate"]


def make_sharded_scaler(precision: PrecisionConfig, device_type: str) -> torch.amp.GradScaler | None:
    """fp16's loss scaler for sharded or staged gradients: it all-reduces the overflow flag, so every rank skips together."""
    if not precision.fp16:
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(
        device_type,
        init_scale=precision.loss_scale_init,
        growth_interval=precision.loss_scale_growth_interval,
    )


def _optimizer_config(cfg: OptimizerConfig, *, sharded_scaler: bool) -> OptimizerConfig:
    """The optimizer settings; fp16's sharded scaler breaks the fused kernel, so auto picks foreach."""
    if sharded_scaler and cfg.implementation == "auto":
        return dataclasses.replace(cfg, implementation="foreach")
    return cfg


def _unwrapped(part: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (FSDP2 wraps in place)."""
    return part.module if isinstance(part, DistributedDataParallel) else part


class PartsStrategy:
    """The loop's verbs over this rank's model parts: one optimizer, one clip, one checkpoint layout."""

    def __init__(self, parts: list[nn.Module], setup: Setup) -> None:
        spec, self.dist = setup.spec, setup.dist
        device, dims = self.dist.device, self.dist.dims
        self.parts = parts
        self.wrap = data_parallel_wrap(spec, dims)
        self.pipelined = dims.pp > 1
        modules = [_unwrapped(part) for part in parts]
        self.model = nn.ModuleList(parts) if self.pipelined else parts[0]
        sharded = STRATEGIES[spec.parallel.strategy].device_mesh or self.pipelined
        self.scaler = (make_sharded_scaler if sharded else make_grad_scaler)(spec.precision, device.type)
        if self.scaler is not None and self.pipelined:  # only the last stage scales a loss
            self.scaler.scale(torch.zeros((), device=device))
        self._optimizer_device = "cpu" if self.wrap == "fsdp" and spec.parallel.cpu_offload else device.type
        optimized = nn.ModuleList(modules) if self.pipelined else modules[0]
        if spec.precision.param_dtype == "bf16":  # bf16 weights and moments, stochastically rounded
            from launcher.components.bf16_adamw import build_bf16_adamw

            self.optimizer = build_bf16_adamw(optimized, spec.optimizer, spec.train.seed)
        else:
            self.optimizer = build_optimizer(
                optimized,
                _optimizer_config(spec.optimizer, sharded_scaler=sharded and self.scaler is not None),
                self._optimizer_device,
            )
        self.max_grad_norm = spec.train.max_grad_norm
        self.powersgd = [
            ddp.register_comm_hook(part, spec.parallel)
            for part in parts
            if isinstance(part, DistributedDataParallel)
        ]
        layout = "stages" if self.pipelined else ("dcp" if sharded else "files")
        self.experts = getattr(modules[0], "expert_shards", None)  # parallel.ep_size > 1
        self.state = PartState(
            self.model, self.optimizer, layout=layout, rank=self.dist.rank, experts=self.experts
        )
        self.pp_group = setup.mesh.get_group("pp") if self.pipelined else None
        names = tied_pair(spec.model) if self.pipelined else None
        self.tied = None  # the first stage's embedding and the last stage's head: one tied matrix
        if names:
            block = dims.world_size // dims.pp
            self.tied = TiedCopies(modules, names, pp_last=dims.pp_last, block=block, rank=self.dist.rank)
        uncounted = self.tied.copies[len(self.tied.counted) :] if self.tied else []
        self._uncounted = {id(t) for t in uncounted}

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Skip gradient communication for a non-final micro batch (a pipeline's schedule syncs by itself)."""
        if self.pipelined:
            return contextlib.nullcontext()
        if self.wrap == "ddp":
            return self.model.no_sync()
        if self.wrap == "fsdp":
            from launcher.parallel.fsdp import deferred_reduction

            return deferred_reduction(self.model)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through the (fp16-scaled) loss; DDP and FSDP2 communicate in their hooks."""
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def _clip(self, params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
        """Clip by the norm of every stage's gradients together (the tied matrix once, each stage's experts
        over their group); returns that norm."""
        if self.experts is not None:  # this stage's norm, its expert slices' over their group (no clipping)
            stage = self.experts.clip([p for p in params if id(p) not in self._uncounted], None)
            squared = stage.to(torch.float32) ** 2
        else:
            counted = [p.grad for p in params if id(p) not in self._uncounted]
            norm = torch.nn.utils.get_total_norm(counted, foreach=True)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            squared = norm.to(torch.float32) ** 2
        dist.all_reduce(squared, group=self.pp_group)
        total = squared.sqrt()
        if max_norm is not None:
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for p in params:
                local_tensor(p.grad).mul_(coef.to(p.grad.dtype))
        return total

    def step(self, *, loss_ok: torch.Tensor) -> StepResult:
        """Clip over all parts and step, never with non-finite values (a pipeline agrees on the loss flag first)."""
        if self.tied is not None:
            self.tied.sync_grads()
        if self.pipelined:
            agreed = loss_ok.to(torch.int32)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.pp_group)
            loss_ok = agreed.bool()
        if loss_ok.device.type != self._optimizer_device:  # parameters offloaded to the CPU
            loss_ok = loss_ok.to(self._optimizer_device)
        clip = self._clip if self.pipelined else None
        if self.experts is not None:  # expert slices: reduced over their replicas, normed over their group
            self.experts.sync_grads()
            clip = self._clip if self.pipelined else self.experts.clip
        return guarded_step(
            self.model.parameters(),
            self.optimizer,
            self.scaler,
            max_grad_norm=self.max_grad_norm,
            loss_ok=loss_ok,
            clip=clip,
        )

    def loss_scale(self) -> float | None:
        """The fp16 loss scale (reads it back from the device; the same on every rank)."""
        return float(self.scaler.get_scale()) if self.scaler else None

    def state_bytes(self) -> dict[str, int]:
        """This rank's parameters, gradients and optimizer state (local shards under FSDP2 and TP)."""
        return state_bytes(self.model, self.optimizer)

    def _powersgd_file(self, index: int) -> str:
        return f"powersgd_rank{self.dist.rank}" + (f"_part{index}" if index else "") + ".pt"

    def save(self, out: CheckpointFiles) -> None:
        """Write this rank's part in the layout of its parts; PowerSGD state is written by every rank."""
        self.state.save(out, self.scaler)
        for index, powersgd in enumerate(self.powersgd):
            if powersgd is not None:
                out.save(ddp.powersgd_state(powersgd), self._powersgd_file(index))

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote."""
        self.state.load(directory, self.scaler)
        for index, powersgd in enumerate(self.powersgd):
            if powersgd is not None:
                ddp.set_powersgd_state(powersgd, load_tensor_file(directory / self._powersgd_file(index)))

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state dict, as it loads into the unwrapped model (collective where sharded or staged)."""
        return self.state.export_state_dict()


def build(parts: list[nn.Module], setup: Setup) -> PartsStrategy:
    """Registry entry point of single, ddp, fsdp, tp and pp."""
    return PartsStrategy(parts, setup)
