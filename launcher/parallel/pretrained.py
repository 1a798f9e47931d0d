"""Pretrained weights into a sharded model: built empty, sharded, then filled from rank 0.

With a pretrained folder (the model family's `from_folder`: `model.path`) under the DTensor strategies (fsdp, tp, both), every rank builds the model with
its parameters on the meta device, the strategy splits it, and only then are the weights read:
rank 0 loads the folder (transformers' `from_pretrained`, float32) and torch's
`set_model_state_dict(..., broadcast_from_rank0=True)` sends each tensor in turn, every rank
keeping its own shard. Peak host memory is the fp32 model on rank 0 and the rank's shard plus
one tensor in flight elsewhere (7B parameters: about 28 GB on rank 0, 28 GB / N plus the largest
matrix, about 0.5 GB, on the others), instead of the whole model on every rank.

Adapters and quantization need the real weights before the strategy wraps the model (bitsandbytes
quantizes them, peft wraps the layers), and a resized embedding does not match the folder's
tensors, so those runs load the folder on every rank instead (`deferred` says which path a run takes).
"""

from __future__ import annotations

import torch
from torch import nn

from launcher.components.model.family import family
from launcher.config.model import ModelConfig
from launcher.parallel.dims import DistContext
from launcher.parallel.registry import STRATEGIES
from launcher.spec import RunSpec


def deferred(spec: RunSpec) -> bool:
    """Whether this run builds its pretrained model empty and fills the shards after wrapping."""
    m, q = spec.model, spec.quantization
    return (
        family(m).from_folder(m)
        and STRATEGIES[spec.parallel.strategy].device_mesh
        and spec.parallel.pp_size == 1  # each stage rank reads the folder and keeps its layers
        and q.method == "none"
        and q.lora.rank == 0
        and not m.resize_embeddings
    )


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, name) that hold one parameter object (a tied embedding and head)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give the meta parameters (sharded or not) real, uninitialized storage on `device`.

    Buffers keep their values, and tied parameters stay one object: `to_empty` swaps in a new
    parameter per module, which would untie a head from its embedding.
    """
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    shared = _shared_parameters(model)
    model.to_empty(device=device)
    for (first, first_name), *others in shared:
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)


def load_into_shards(model: nn.Module, cfg: ModelConfig, dist: DistContext) -> None:
    """Materialize `model` (already split by TP/FSDP) and fill it with the folder's weights, read once on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    materialize(model, dist.device)
    full = family(cfg).build(cfg, announce=False).state_dict() if dist.is_main else {}
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    )
    del full
