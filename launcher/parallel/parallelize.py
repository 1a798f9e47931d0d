"""Parallelism applied to one model part (the whole model, or one pipeline stage), in one fixed order.

`parallelize` is the only place the order lives (torchtitan's: TP, then checkpointing, then
compile, then the data-parallel wrap), each step commented where it happens. The micro-batch
search (launcher.rank.micro_batch) is a hook, `measure`, between checkpointing and compile: it must
see the eager model with its checkpointing and tensor-parallel split, and compile must trace
whatever the search leaves; under FSDP2 it measures the sharded model instead, last, after the
wrap and the shards' values (the memory of a step is the sharded one). DeepSpeed wraps the model in its own engine when its strategy is built,
so its parts leave here unwrapped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launcher.components import memory
from launcher.components.compile import apply as compile_model
from launcher.parallel import pretrained
from launcher.parallel.dims import DistContext
from launcher.parallel.registry import STRATEGIES
from launcher.spec import RunSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from launcher.components.model.meta_init import MetaInit
    from launcher.parallel.dims import ParallelDims


def data_parallel_wrap(spec: RunSpec, dims: ParallelDims) -> str:
    """The wrap each part gets last: none, ddp, fsdp, or engine (DeepSpeed's own, at strategy build)."""
    entry = STRATEGIES[spec.parallel.strategy]
    if not entry.wrap_one_rank and dims.dp_size == 1:
        return "none"  # the pp alias: plain stages where no other rank holds the same stage
    if entry.wrap == "none" and dims.cp > 1:
        return "ddp"  # context-parallel ranks hold different tokens: their gradients are averaged
    return entry.wrap


def run_mesh(spec: RunSpec, dist: DistContext) -> DeviceMesh | None:
    """The run's one device mesh, built once where DTensors or a pipeline need it (None elsewhere)."""
    if (
        STRATEGIES[spec.parallel.strategy].device_mesh
        or dist.dims.pp > 1
        or dist.dims.cp > 1
        or spec.parallel.ep_size > 1
    ):
        return dist.dims.build_mesh(dist.device.type)
    return None


def _elsewhere(part: nn.Module, device: torch.device) -> bool:
    """Whether any tensor of `part` is off `device` (moving fake tensors in place is refused: a simulation's)."""
    return any(t.device != device for t in (*part.parameters(), *part.buffers()))


def parallelize(
    part: nn.Module,
    *,
    spec: RunSpec,
    dist: DistContext,
    mesh: DeviceMesh | None,
    empty: bool = False,
    init: MetaInit | None = None,
    measure: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Apply (the cp group, the expert slices) -> TP -> activation checkpointing/offload -> (measure) -> compile -> data-parallel wrap
    (-> measure, under FSDP2).

    `empty`: the part was built without weights (a pretrained folder under fsdp/tp); they are read
    into its shards after the wrap. `init`: the part was built on the meta device; its initial
    values are regenerated into its shards after the wrap.
    """
    dims, device = dist.dims, dist.device
    wrap = data_parallel_wrap(spec, dims)
    on_meta = empty or init is not None
    if not on_meta and wrap != "engine" and _elsewhere(part, device):  # DeepSpeed places the model itself
        part = part.to(device)
    # 0. context parallel: the part's attention gathers keys and values over the mesh's cp axis
    if dims.cp > 1:
        from launcher.components.model.context_parallel import ContextGroup
        from launcher.components.model.moe_balance import moe_blocks

        part.context_parallel = ContextGroup(
            group=mesh["cp"].get_group(), rank=dims.cp_rank(dist.rank), size=dims.cp
        )
        for block in moe_blocks(part).values():  # their per-row auxiliary losses sum over the group
            block.context_parallel = part.context_parallel
    # 0b. expert parallel: this rank keeps its slice of each MoE block's experts; the tokens travel to them
    if spec.parallel.ep_size > 1:
        from launcher.components.model import hf_expert_parallel
        from launcher.parallel import expert_parallel

        part.expert_shards = expert_parallel.apply(part, mesh, spec.parallel.ep_size, dtensors=wrap == "fsdp")
        # a transformers experts module's forward sends its tokens through the group (the built-in MoE's does already)
        hf_expert_parallel.dispatch(part)
    # 1. tensor parallelism splits the blocks' projections into DTensors over the mesh's tp axis
    if dims.tp > 1:
        # DTensor and DCP take about a second to import: only a tensor-parallel run pays for them
        from launcher.parallel.tensor_parallel import apply_tensor_parallel

        part = apply_tensor_parallel(part, mesh["tp"], sequence_parallel=spec.parallel.sequence_parallel)
    # 2. activation checkpointing and offload wrap the (split) blocks' forward
    part = memory.apply(part, spec.memory)
    if measure is not None and wrap != "fsdp":  # the micro-batch search measures this eager part
        measure(part)
    # 3. compile traces each block with its checkpointing and tensor-parallel hooks inside
    compile_model(part, spec.compile)
    # 4. the data-parallel wrap shards (FSDP2) or replicates (DDP) what it is given
    if wrap == "fsdp":
        from launcher.parallel.fsdp import apply_fsdp, data_mesh

        part = apply_fsdp(
            part,
            data_mesh(mesh, dims.dp_replicate, dims.cp),
            parallel=spec.parallel,
            precision=spec.precision,
            pin_memory=device.type == "cuda",
        )
    elif wrap == "ddp":
        from launcher.parallel.ddp import apply_ddp

        # without a pipeline DDP spans every rank; with one, the ranks holding the same stage
        group = mesh["dp_shard"].get_group() if dims.pp > 1 else None
        if spec.parallel.ep_size > 1:  # the expert slices differ between ranks: ExpertShards reduces them
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                part, list(part.expert_shards.params)
            )
        part = apply_ddp(part, device, spec.parallel, group)
    if empty:  # built empty: the shards receive the pretrained weights now
        pretrained.load_into_shards(part, spec.model, dist)
    elif init is not None:  # built on the meta device: the shards receive the eager build's values now
        init.fill(part, device)
    if measure is not None and wrap == "fsdp":  # the search measures what a step holds: this rank's shards
        measure(part)
    return part
