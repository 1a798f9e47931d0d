"""Tensor parallelism of a model part (parallel.tp_size > 1): DTensor `parallelize_module` over the mesh's tp axis.

The model's family gives the plan (launcher.components.model.family.TensorParallelPlan: the styles of one
decoder layer, where its head and embedding are, what sequence parallelism adds); this module applies it.
For the built-in GPT and Llama-style models: per block, q/k/v and the MLP up projection are split
column-wise (each rank holds whole heads and a slice of the hidden width) and o_proj and the MLP
down projection row-wise, so one all-reduce ends each branch. The attention derives its local head count from q_proj's output width, which
is what makes the column split work without touching the model. With sequence parallelism the
norms run on a sequence shard, the residual stream between branches is split along the sequence
(all-gather before a branch, reduce-scatter after it instead of an all-reduce).

The head and the token embedding are split over the vocabulary, as torchtitan does: the head
column-wise with its output left a DTensor sharded on the last dimension, so each rank holds only
its [B, T, vocab / tp] slice of the logits and the loss runs over the slices
(launcher.components.model.vocab_parallel); the embedding row-wise (each rank looks up the ids of
its vocabulary range, one all-reduce sums them). A tied head and embedding are one parameter,
sharded once. Position embeddings and the remaining norms stay replicated: they are made
replicated DTensors so that optimizer and clipping see one kind of parameter. Every rank of a
tensor-parallel group reads the same batch; strategy `tp` is this alone (the world size equals
tp_size); strategy fsdp with parallel.tp_size adds FSDP2 over the data-parallel axes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from launcher.components.model.family import decoder_layers, family_of

__all__ = ["apply_tensor_parallel"]


class ReplicateParallel(ParallelStyle):
    """Keep a module whole on every rank, its parameters replicated DTensors; inputs and outputs plain.

    A DTensor input (e.g. a sequence shard) is gathered to a replicated one first. Parameters
    already converted (a tied weight) are reused, so weight tying survives.
    """

    def __init__(self, converted: dict[int, nn.Parameter]) -> None:
        super().__init__()
        self._converted = converted

    def _replicate_params(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            if id(param) not in self._converted:
                replicated = distribute_tensor(param.data, mesh, [Replicate()])
                self._converted[id(param)] = nn.Parameter(replicated, requires_grad=param.requires_grad)
            module.register_parameter(key, self._converted[id(param)])

    @staticmethod
    def _inputs(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        def convert(x: Any) -> Any:
            if isinstance(x, DTensor):
                return x.redistribute(mesh, [Replicate()])
            if isinstance(x, torch.Tensor):
                return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return x

        return tuple(convert(x) for x in inputs)

    @staticmethod
    def _outputs(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        return output.to_local() if isinstance(output, DTensor) else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate_params, self._inputs, self._outputs)


def _module_at(model: nn.Module, dotted: str) -> nn.Module | None:
    """The submodule at `dotted`, or None where a pipeline stage lacks it."""
    module: nn.Module | None = model
    for part in dotted.split("."):
        module = getattr(module, part, None)
    return module


def head_style(sequence_parallel: bool) -> ColwiseParallel:
    """The LM head split over the vocabulary; its logits stay a DTensor sharded on the last dimension."""
    return ColwiseParallel(
        input_layouts=Shard(1) if sequence_parallel else Replicate(),
        output_layouts=Shard(-1),
        use_local_output=False,
    )


def _split_head_and_embedding(
    model: nn.Module, tp_mesh: DeviceMesh, head: str, embedding: str, *, sequence_parallel: bool
) -> None:
    """Split `head` column-wise and `embedding` row-wise over the vocabulary (either may be absent on a stage).

    torch's styles give each its own parameter object; a tied pair gets its one parameter back.
    """
    head_module, embedding_module = _module_at(model, head), _module_at(model, embedding)
    tied = (
        head_module is not None
        and embedding_module is not None
        and head_module.weight is embedding_module.weight
    )
    plan: dict[str, ParallelStyle] = {}
    if embedding_module is not None:
        # ids in whole, each rank looks up its vocabulary range, the summed lookups out whole
        plan[embedding] = RowwiseParallel(input_layouts=Replicate())
    if head_module is not None:
        plan[head] = head_style(sequence_parallel)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if tied:
        head_module.weight = embedding_module.weight


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> nn.Module:
    """Split the model as its family's plan says (launcher.components.model.family); every other parameter replicated.

    Each decoder layer by the plan's layer styles, the head and embedding over the vocabulary, then the
    plan's top-level styles (those a pipeline stage holds), then every module still holding plain
    parameters becomes replicated.
    """
    plan = family_of(model).tp_plan(model, sequence_parallel=sequence_parallel)
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to split.")
    for layer in layers:
        parallelize_module(layer, tp_mesh, plan.layer)
    _split_head_and_embedding(model, tp_mesh, plan.head, plan.embedding, sequence_parallel=sequence_parallel)
    present = {path: style for path, style in plan.top.items() if _module_at(model, path) is not None}
    if present:  # a pipeline stage lacks the parts other stages hold
        parallelize_module(model, tp_mesh, present)
    converted: dict[int, nn.Parameter] = {}
    for module in list(model.modules()):
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            parallelize_module(module, tp_mesh, ReplicateParallel(converted))
    return model
