"""Loads across checkpoint layouts: what lets a run continue under another strategy or world size.

- a DCP checkpoint (fsdp, tp) into one whole, replicated model (single, ddp): DCP reads the shards
  into the unwrapped model's own full tensors (it reshards to any tensor layout);
- a files checkpoint (single, ddp: model.pt, optimizer.pt) into sharded parts (fsdp, tp): rank 0
  reads the full state dicts and `set_state_dict(full_state_dict=True, broadcast_from_rank0=True)`
  shards them to this run's mesh; optimizer.pt's integer parameter ids are named first (the
  optimizer orders its parameters as the model's named_parameters, in both runs);
- a DeepSpeed checkpoint into either: its fp32 weights (DeepSpeed's zero_to_fp32) load, the
  optimizer state does not (ZeRO keeps it flattened per rank), so the optimizer's moments and step
  counts restart from zero; a warning says so.
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
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from launcher.components.adapters import load_checkpoint_state
from launcher.components.checkpoint import load_tensor_file
from launcher.components.files.dcp_reader import SafeReader
from launcher.parallel.checkpoint_layout import DCP_DIR, OPTIMIZER_RESTARTS


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def load_dcp_into_whole(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Read a DCP checkpoint (fsdp, tp) into an unwrapped, replicated model and its optimizer (every rank)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, storage_reader=SafeReader(Path(directory) / DCP_DIR))  # no code from the files runs
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def named_optimizer_state(saved: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """optimizer.pt (parameters by integer id) as a full optimizer state dict keyed by parameter name.

    Ids count the parameters of the optimizer's groups in order; this run's optimizer was built over
    the same model by the same rules, so its i-th parameter is the saved i-th one (checked by count).
    """
    names = {id(p): name for name, p in model.named_parameters()}
    groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    saved_groups = saved["param_groups"]
    if [len(g) for g in groups] != [len(g["params"]) for g in saved_groups]:
        raise ValueError(
            "optimizer.pt's parameter groups do not match this run's optimizer (another optimizer or model "
            "setting?): resume with the settings that wrote it, or export its weights with train-export."
        )
    by_id = {pid: name for group, saved_group in zip(groups, saved_groups, strict=True)
             for pid, name in zip(saved_group["params"], group, strict=True)}  # fmt: skip
    return {
        "state": {by_id[pid]: value for pid, value in saved["state"].items()},
        "param_groups": [
            {**saved_group, "params": group} for group, saved_group in zip(groups, saved_groups, strict=True)
        ],
    }


def load_files_into_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Shard a files checkpoint (model.pt, optimizer.pt) onto this run's mesh: rank 0 reads, all ranks receive."""
    model_state, optim_state = {}, {}
    if _is_main():
        model_state = load_tensor_file(Path(directory) / "model.pt")
        optim_state = named_optimizer_state(
            load_tensor_file(Path(directory) / "optimizer.pt"), model, optimizer
        )
    # one call each: set_state_dict treats an empty model dict (ranks other than 0) as optimizer-only
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)


def load_deepspeed_weights(model: nn.Module, directory: Path, *, sharded: bool) -> None:
    """The fp32 weights of a DeepSpeed checkpoint into this run's model; the optimizer state restarts (warned)."""
    from launcher.parallel.deepspeed import consolidate

    if sharded:
        state = consolidate(directory) if _is_main() else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, state, options=options)
    else:
        load_checkpoint_state(model, consolidate(directory))
    if _is_main():
        warnings.warn(f"resuming the DeepSpeed checkpoint {directory} under another layout: {OPTIMIZER_RESTARTS}.",
                      stacklevel=2)  # fmt: skip
