"""What the DTensor strategies (fsdp, tp) share: the loop's verbs over DTensor parameters and DCP checkpoints.

Both strategies leave every parameter a DTensor, so one optimizer, one clip over DTensors and one
checkpoint format serve them. Checkpoints are written sharded with torch.distributed.checkpoint
(DCP): every rank writes its own shards into `dcp/` of the checkpoint directory, and a load
reshards to whatever mesh the resuming run has, so the world size may change between sessions. With
adapters only the trainable parameters are written (the frozen base is rebuilt from the spec).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from launcher.groups.adapters import check_loaded_keys, frozen_keys, has_adapters
from launcher.groups.checkpoint import load_tensor_file
from launcher.groups.checkpoint_files import CheckpointFiles
from launcher.groups.optimizer import OptimizerConfig, build_optimizer
from launcher.groups.precision import PrecisionConfig
from launcher.parallel.checkpoint_layout import DCP_DIR
from launcher.parallel.dims import DistContext
from launcher.parallel.guarded_step import guarded_step
from launcher.parallel.state_bytes import state_bytes
from launcher.parallel.strategy import Setup, StepResult, WholeModelVerbs

SCALER_FILE = "scaler.pt"


class DTensorStrategy(WholeModelVerbs):
    """Loop verbs for a model whose parameters are all DTensors (FSDP2, tensor parallel, or both).

    `no_sync` is given by the wrapping strategy (FSDP2 defers its reduce-scatter; tensor parallel
    alone has no data-parallel gradients to defer). Clipping runs over DTensor gradients and
    yields the global norm as a plain tensor, so the non-finite guard sees one value on all ranks.
    """

    def __init__(
        self,
        model: nn.Module,
        setup: Setup,
        *,
        no_sync: Callable[[], contextlib.AbstractContextManager],
        scaler: torch.amp.GradScaler | None,
        optimizer_device: str,
    ) -> None:
        self.model = model
        self.dist: DistContext = setup.dist
        self._no_sync = no_sync
        self.scaler = scaler
        self._optimizer_device = optimizer_device
        self.optimizer = build_optimizer(model, sharded_optimizer_config(setup, scaler), optimizer_device)
        self.max_grad_norm = setup.spec.train.max_grad_norm
        self.adapters = has_adapters(model)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Skip gradient communication for a non-final micro batch."""
        return self._no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through the (fp16-scaled) loss; FSDP2 reduce-scatters in its hooks."""
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, *, loss_ok: torch.Tensor) -> StepResult:
        """Clip over all shards and step, never with non-finite values."""
        if loss_ok.device.type != self._optimizer_device:  # parameters offloaded to the CPU
            loss_ok = loss_ok.to(self._optimizer_device)
        return guarded_step(
            self.model.parameters(),
            self.optimizer,
            self.scaler,
            max_grad_norm=self.max_grad_norm,
            loss_ok=loss_ok,
        )

    def loss_scale(self) -> float | None:
        """The fp16 loss scale (identical on all ranks: overflow flags are all-reduced)."""
        return float(self.scaler.get_scale()) if self.scaler else None

    def state_bytes(self) -> dict[str, int]:
        """This rank's local shards of parameters, gradients and optimizer state."""
        return state_bytes(self.model, self.optimizer)

    def _state(self) -> tuple[dict, dict]:
        """Model and optimizer state as DCP saves it; with adapters without the frozen base."""
        options = StateDictOptions(ignore_frozen_params=self.adapters)
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        if self.adapters:  # torch drops a frozen parameter by its first name only: drop tied aliases too
            frozen = frozen_keys(self.model)
            model_state = {k: v for k, v in model_state.items() if k not in frozen}
        return model_state, optim_state

    def save(self, out: CheckpointFiles) -> None:
        """Every rank writes its shards of model and optimizer state into `dcp/` (DCP names them by rank)."""
        model_state, optim_state = self._state()
        dcp_dir = out.directory / DCP_DIR
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=dcp_dir)
        out.adopt(
            dcp_dir.glob(f"__{self.dist.rank}_*.distcp")
        )  # this rank's shards; rank 0's manifest adds .metadata
        if self.scaler is not None and self.dist.is_main:
            out.save(self.scaler.state_dict(), SCALER_FILE)

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote, resharded to this run's mesh (any world size).

        With adapters, the checkpoint's model keys must be exactly the trainable ones (checked on its
        metadata: DCP alone would ignore extra keys), and only those are set.
        """
        model_state, optim_state = self._state()
        if self.adapters:
            check_loaded_keys(self.model, saved_model_keys(directory))
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=directory / DCP_DIR)
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
            options=StateDictOptions(strict=not self.adapters),
        )  # fmt: skip
        if self.scaler is not None:
            self.scaler.load_state_dict(load_tensor_file(directory / SCALER_FILE))

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded model state dict on rank 0 (on the CPU); empty on other ranks. Collective."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)


def make_sharded_scaler(precision: PrecisionConfig, device_type: str) -> torch.amp.GradScaler | None:
    """fp16's loss scaler for sharded gradients: it all-reduces the overflow flag, so every rank skips together."""
    if not precision.fp16:
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(
        device_type,
        init_scale=precision.loss_scale_init,
        growth_interval=precision.loss_scale_growth_interval,
    )


def sharded_optimizer_config(setup: Setup, scaler: torch.amp.GradScaler | None) -> OptimizerConfig:
    """The optimizer settings; fp16's sharded scaler breaks the fused kernel, so auto picks foreach."""
    cfg = setup.spec.optimizer
    if scaler is not None and cfg.implementation == "auto":
        return dataclasses.replace(cfg, implementation="foreach")
    return cfg


def consolidate(directory: Path) -> dict[str, torch.Tensor]:
    """The full model state dict of a DCP checkpoint, offline in one process (no process group).

    Keys are the unwrapped model's (FSDP2 and tensor parallel keep parameter names), so the result
    loads into `launcher.groups.model.gpt.build_model` with `load_state_dict`; an adapter run's holds
    only the trainable parameters (adapters.load_checkpoint_state).
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "full.pt"
        dcp_to_torch_save(Path(directory) / DCP_DIR, target)
        full = torch.load(target, map_location="cpu", weights_only=True)
    return {k: v for k, v in full["model"].items()}


def saved_model_keys(directory: Path) -> set[str]:
    """The model state-dict keys a DCP checkpoint holds (read from its metadata, no tensor loaded)."""
    metadata = dcp.FileSystemReader(Path(directory) / DCP_DIR).read_metadata()
    return {key.removeprefix("model.") for key in metadata.state_dict_metadata if key.startswith("model.")}
