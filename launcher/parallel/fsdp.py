"""The FSDP2 wrap of a model part (strategy fsdp, and fsdp inside pipeline stages): `fully_shard` per block, then the root.

Each decoder layer (the GPT's blocks, a transformers model's layers) is one communication group: its parameters are all-gathered just before its forward
(and again for backward after a reshard) and its gradients reduce-scattered right after its
backward, so at most a few blocks are ever unsharded. The root group holds the embeddings, the
final norm and the tied LM head. Options:

- reshard_after_forward: true frees gathered blocks after forward (full_shard); false keeps them
  until backward (shard_grad_op: less communication, more memory).
- replicate_degree > 1: hybrid sharding on a 2-D mesh (replicate x shard): parameters are sharded
  within a group and gradients all-reduced across the replicas.
- cpu_offload: sharded parameters, gradients and optimizer state live on the CPU (pinned memory on
  CUDA); the optimizer steps there.
- prefetch_layers: blocks whose all-gather is issued ahead of use, forward and backward.
- ep_size > 1: each experts site is an FSDP2 group of its own first, its expert slices sharded over the
  ranks holding the same experts (launcher.parallel.expert_parallel.fully_shard_experts).
- tp_size > 1: tensor parallel inside each data-parallel group (the mesh's tp axis), applied before
  activation checkpointing, compile and this wrap by launcher.parallel.parallelize.

Precision comes from the precision group: bf16 gathers parameters in bf16 and reduces gradients in
fp32; fp16 likewise with fp16 parameters and a loss scaler whose overflow flag is all-reduced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from launcher.components.model.family import decoder_layers
from launcher.config.parallel import ParallelConfig
from launcher.config.precision import PrecisionConfig

__all__ = ["apply_fsdp", "data_mesh", "deferred_reduction", "mixed_precision_policy"]


def mixed_precision_policy(precision: PrecisionConfig) -> MixedPrecisionPolicy | None:
    """Low-precision parameters for compute, fp32 gradient reduction; None (plain fp32) otherwise.

    Pure bf16 (precision.param_dtype=bf16) stores the shards in bf16 already: they are gathered as they are,
    and the gradients are reduce-scattered in fp32 and stored back in bf16.
    """
    if precision.param_dtype == "bf16":
        return MixedPrecisionPolicy(reduce_dtype=torch.float32)
    if precision.bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision.fp16:
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return None


def data_mesh(mesh: DeviceMesh, replicate: int, cp: int = 1) -> DeviceMesh:
    """The mesh FSDP2 shards over: 1-D (dp_shard) or 2-D (dp_replicate, dp_shard) for hybrid sharding.

    Under context parallel the cp ranks hold different tokens of the same batch, so their gradients
    average like data parallel ones: the shard dimension is dp_shard x cp flattened (torchtitan's
    dp_shard_cp), and the parameters are sharded over it too.
    """
    shard = "dp_shard"
    if cp > 1:
        shard = "dp_shard_cp"
        try:
            mesh[shard]
        except KeyError:  # flattened once per mesh
            mesh["dp_shard", "cp"]._flatten(shard)
    return mesh["dp_replicate", shard] if replicate > 1 else mesh[shard]


def _set_prefetch(blocks: list[FSDPModule], num_layers: int) -> None:
    """Issue the all-gathers of the next `num_layers` blocks ahead of use (forward and backward)."""
    if num_layers <= 0:
        return
    for i, block in enumerate(blocks):
        ahead = blocks[i + 1 : i + 1 + num_layers]
        behind = blocks[max(i - num_layers, 0) : i][::-1]
        if ahead:
            block.set_modules_to_forward_prefetch(ahead)
        if behind:
            block.set_modules_to_backward_prefetch(behind)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    pin_memory: bool,
) -> nn.Module:
    """fully_shard each decoder layer (the GPT's blocks, a transformers model's layers), then the root, over `mesh`."""
    kwargs: dict = {"mesh": mesh, "reshard_after_forward": parallel.reshard_after_forward}
    policy = mixed_precision_policy(precision)
    if policy is not None:
        kwargs["mp_policy"] = policy
    kwargs["offload_policy"] = (
        CPUOffloadPolicy(pin_memory=pin_memory) if parallel.cpu_offload else OffloadPolicy()
    )
    shards = getattr(model, "expert_shards", None)
    if shards is not None:  # expert slices: split over their group already, sharded over their replicas
        from launcher.parallel.expert_parallel import fully_shard_experts

        fully_shard_experts(shards, **kwargs)
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to shard one by one.")
    for layer in layers:
        fully_shard(layer, **kwargs)
    # a chunked loss calls the root's head after forward: the root's parameters stay gathered until backward
    chunked = str(getattr(model, "loss_chunks", "1")) != "1"
    fully_shard(model, **{**kwargs, "reshard_after_forward": False} if chunked else kwargs)
    _set_prefetch(list(layers), parallel.prefetch_layers)
    return model


@contextlib.contextmanager
def deferred_reduction(model: FSDPModule) -> Iterator[None]:
    """Accumulate unsharded gradients locally; the final micro batch reduce-scatters the sum."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
