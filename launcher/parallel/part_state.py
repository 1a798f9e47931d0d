"""Checkpoint and export of a rank's model parts, written once for every torch-native strategy.

Three layouts, chosen by what the parts are, each the format earlier versions wrote:

- files: one whole, replicated model (single, ddp): rank 0 writes model.pt, optimizer.pt (and
  scaler.pt); every rank loads them. With adapters only the trainable parameters are written.
- dcp: one model whose parameters are DTensors (fsdp, tp): every rank writes its shards into `dcp/`
  with torch.distributed.checkpoint, and a load reshards to the resuming run's mesh.
- stages: a pipeline's parts (whatever wraps them: FSDP2, DDP or nothing) as DCP under the whole
  model's names (stages keep them), so any stage split of the same model resumes it and
  `consolidate` reads it like an fsdp checkpoint.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from launcher.components.adapters import (
    check_loaded_keys,
    checkpoint_state,
    frozen_keys,
    has_adapters,
    load_checkpoint_state,
)
from launcher.components.checkpoint import load_tensor_file
from launcher.components.checkpoint_async import StagedFiles
from launcher.components.checkpoint_files import CheckpointFiles
from launcher.components.files.dcp_reader import SafeReader, load_full_state, read_metadata
from launcher.parallel.checkpoint_layout import DCP_DIR, checkpoint_kind, is_dcp_checkpoint
from launcher.parallel.expert_parallel import ExpertShards
from launcher.parallel.state_convert import (
    load_dcp_into_whole,
    load_deepspeed_weights,
    load_files_into_sharded,
)

SCALER_FILE = "scaler.pt"
LAYOUTS = ("files", "dcp", "stages")
_STAGE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _drop_part(key: str) -> str:
    """'0.blocks.1.w' -> 'blocks.1.w'; 'state.0.blocks.1.w.exp_avg' -> 'state.blocks.1.w.exp_avg'."""
    head, rest = key.split(".", 1)
    if head in ("state", "param_groups"):
        return f"{head}.{rest.split('.', 1)[1]}"
    return rest


class PartState:
    """Saves, loads and exports `model` (one model, or a ModuleList of stages) and its optimizer in one layout."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        layout: str,
        rank: int,
        experts: ExpertShards | None = None,
    ) -> None:
        self.model, self.optimizer, self.layout, self.rank = model, optimizer, layout, rank
        self.adapters = has_adapters(model)
        self.experts = experts
        """Expert slices (files layout, parallel.ep_size > 1): written whole, cut to this rank's on load."""

    def _whole(self) -> nn.Module:
        """The one model of the files layout, without its DDP wrapper."""
        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

    def _dcp_state(self) -> tuple[dict, dict, dict[str, str]]:
        """Model and optimizer state as DCP saves it, and (stages) the part-prefixed name of each saved key."""
        if self.layout == "stages":
            model_state, optim_state = get_state_dict(self.model, self.optimizer, options=_STAGE_OPTIONS)
            names = {_drop_part(k): k for k in (*model_state, *optim_state)}
            return (
                {_drop_part(k): v for k, v in model_state.items()},
                {_drop_part(k): v for k, v in optim_state.items()},
                names,
            )
        options = StateDictOptions(ignore_frozen_params=self.adapters)
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        if self.adapters:  # torch drops a frozen parameter by its first name only: drop tied aliases too
            frozen = frozen_keys(self.model)
            model_state = {k: v for k, v in model_state.items() if k not in frozen}
        return model_state, optim_state, {}

    def save(self, out: CheckpointFiles | StagedFiles, scaler: torch.amp.GradScaler | None) -> None:
        """Write this rank's part: rank 0 the replicated files, or every rank its DCP shards."""
        if self.layout == "files" and self.experts is not None:  # every rank gathers the whole experts
            model_state = self.experts.full_model(checkpoint_state(self._whole()))
            optim_state = self.experts.full_optimizer(self.optimizer)
            if self.rank == 0:
                out.save(model_state, "model.pt")
                out.save(optim_state, "optimizer.pt")
        elif self.layout == "files":
            if self.rank == 0:
                out.save(checkpoint_state(self._whole()), "model.pt")
                out.save(self.optimizer.state_dict(), "optimizer.pt")
        else:
            model_state, optim_state, _ = self._dcp_state()
            state, own_files = {"model": model_state, "optim": optim_state}, f"__{self.rank}_*.distcp"
            if isinstance(out, StagedFiles):  # an asynchronous save: torch's async_save writes it
                out.save_dcp(state, DCP_DIR, own_files)
            else:
                dcp.save(state, checkpoint_id=out.directory / DCP_DIR)
                out.adopt((out.directory / DCP_DIR).glob(own_files))  # rank 0's manifest adds .metadata
        if scaler is not None and self.rank == 0:
            out.save(scaler.state_dict(), SCALER_FILE)

    def load(self, directory: Path, scaler: torch.amp.GradScaler | None) -> None:
        """Restore a checkpoint: what `save` wrote (DCP reshards to this run's mesh, or stage split), or
        another layout's (launcher.parallel.state_convert: files <-> dcp, DeepSpeed's weights).

        With adapters under DCP, the checkpoint's model keys must be exactly the trainable ones
        (checked on its metadata: DCP alone would ignore extra keys), and only those are set.
        """
        written = checkpoint_kind(directory)
        if written == "deepspeed":
            load_deepspeed_weights(self._whole(), directory, sharded=self.layout != "files")
        elif self.layout == "files" and written == "dcp":
            load_dcp_into_whole(self._whole(), self.optimizer, directory)
        elif self.layout == "files" and self.experts is not None:  # whole experts, cut to this rank's
            model_state = self.experts.local_model(load_tensor_file(directory / "model.pt"))
            load_checkpoint_state(self._whole(), model_state)
            optim_state = load_tensor_file(directory / "optimizer.pt")
            self.optimizer.load_state_dict(self.experts.local_optimizer(optim_state, self.optimizer))
        elif self.layout == "files":
            load_checkpoint_state(self._whole(), load_tensor_file(directory / "model.pt"))
            self.optimizer.load_state_dict(load_tensor_file(directory / "optimizer.pt"))
        elif written == "files":
            load_files_into_sharded(self.model, self.optimizer, directory)
        else:
            self._load_dcp(directory)
        if scaler is not None and written != "deepspeed":
            scaler.load_state_dict(load_tensor_file(directory / SCALER_FILE))
        elif scaler is not None and self.rank == 0:  # DeepSpeed keeps its loss scale inside its own files
            warnings.warn(f"{directory} is DeepSpeed's: the fp16 loss scale restarts at its initial value.",
                          stacklevel=2)  # fmt: skip

    def _load_dcp(self, directory: Path) -> None:
        model_state, optim_state, names = self._dcp_state()
        if self.adapters:
            check_loaded_keys(self.model, saved_model_keys(directory))
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, storage_reader=SafeReader(directory / DCP_DIR))  # no code from the files runs
        if self.layout == "stages":
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict={names[k]: v for k, v in state["model"].items()},
                optim_state_dict={names[k]: v for k, v in state["optim"].items()},
                options=_STAGE_OPTIONS,
            )
            return
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
            options=StateDictOptions(strict=not self.adapters),
        )  # fmt: skip

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state dict (dcp, stages: on rank 0 only, on the CPU; collective)."""
        if self.layout == "files" and self.experts is not None:
            return self.experts.full_model(self._whole().state_dict())
        if self.layout == "files":
            return self._whole().state_dict()
        if self.layout == "dcp":
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_model_state_dict(self.model, options=options)
        full_options = StateDictOptions(full_state_dict=True)
        own = {
            _drop_part(k): v.cpu() for k, v in get_model_state_dict(self.model, options=full_options).items()
        }
        main = self.rank == 0
        gathered: list[dict | None] = [None] * dist.get_world_size() if main else []
        dist.gather_object(own, gathered if main else None, dst=0)
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            full.update(part or {})
        return full


def consolidate(directory: Path) -> dict[str, torch.Tensor]:
    """The model state dict of a checkpoint any layout wrote, offline in one process (no process group).

    Keys are the unwrapped model's (FSDP2, tensor parallel and stages keep parameter names), so the
    result loads into `launcher.components.model.build.build_model`; an adapter run's holds only the
    trainable parameters (adapters.load_checkpoint_state).
    """
    if not is_dcp_checkpoint(directory):
        return load_tensor_file(Path(directory) / "model.pt")
    return dict(load_full_state(Path(directory) / DCP_DIR, "model")["model"].items())


def saved_model_keys(directory: Path) -> set[str]:
    """The model state-dict keys a DCP checkpoint holds (read from its metadata, no tensor loaded)."""
    metadata = read_metadata(Path(directory) / DCP_DIR / ".metadata")
    return {key.removeprefix("model.") for key in metadata.state_dict_metadata if key.startswith("model.")}
