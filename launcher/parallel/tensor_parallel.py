"""Tensor parallelism of a model part (parallel.tp_size > 1): DTensor `parallelize_module` over the mesh's tp axis.

Per block, q/k/v and the MLP up projection are split column-wise (each rank holds whole heads and
a slice of the hidden width) and o_proj and the MLP down projection row-wise, so one all-reduce
ends each branch. The attention derives its local head count from q_proj's output width, which
is what makes the column split work without touching the model. With sequence parallelism the
norms run on a sequence shard, the residual stream between branches is split along the sequence
(all-gather before a branch, reduce-scatter after it instead of an all-reduce).

Token and position embeddings, the final norm and the (tied) LM head stay replicated: they are
made replicated DTensors so that optimizer and clipping see one kind of parameter. Every rank of
a tensor-parallel group reads the same batch; strategy `tp` is this alone (the world size equals
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
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from launcher.components.model.hf import HFCausalLM, decoder_layers
from launcher.components.model.hf_files import layer_tp_plan

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


def _block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan of one transformer block (names of launcher.components.model.gpt.Block)."""
    branch_out = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=branch_out),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=branch_out),
    }
    if sequence_parallel:
        # norms on the sequence shard; each branch gathers the full sequence before its projections
        gather = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
        plan.update(
            {"norm_attn": SequenceParallel(), "norm_mlp": SequenceParallel(), "attn": gather, "mlp": gather}
        )
    return plan


_STYLES: dict[str, type[ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def _apply_hf(model: HFCausalLM, tp_mesh: DeviceMesh) -> nn.Module:
    """Split each decoder layer by the config's own plan; replicate every other parameter."""
    plan = layer_tp_plan(model.hf.config)
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model.hf).__name__}: no decoder layers found to split.")
    for layer in layers:
        parallelize_module(layer, tp_mesh, {name: _STYLES[style]() for name, style in plan.items()})
    converted: dict[int, nn.Parameter] = {}
    for module in list(model.modules()):
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            parallelize_module(module, tp_mesh, ReplicateParallel(converted))
    return model


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> nn.Module:
    """Shard the model's blocks over `tp_mesh`; every other parameter becomes a replicated DTensor."""
    if isinstance(model, HFCausalLM):
        if sequence_parallel:
            raise ValueError("sequence parallelism is applied to the built-in GPT only.")
        return _apply_hf(model, tp_mesh)
    for block in model.blocks:
        parallelize_module(block, tp_mesh, _block_plan(sequence_parallel))
    converted: dict[int, nn.Parameter] = {}
    top: dict[str, ParallelStyle] = {
        "tok_emb": ReplicateParallel(converted),
        "pos_emb": ReplicateParallel(converted),
        "lm_head": ReplicateParallel(converted),  # tied to tok_emb: the same replicated parameter
    }
    if sequence_parallel:
        # the residual stream enters the blocks split along the sequence; norm_f leaves it so
        top["blocks.0"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        top["norm_f"] = SequenceParallel()
    else:
        top["norm_f"] = ReplicateParallel(converted)
    present = {k: v for k, v in top.items() if getattr(model, k.split(".")[0], None) is not None}
    parallelize_module(model, tp_mesh, present)  # a pipeline stage lacks the parts other stages hold
    for block in model.blocks:
        if not sequence_parallel:
            parallelize_module(
                block,
                tp_mesh,
                {"norm_attn": ReplicateParallel(converted), "norm_mlp": ReplicateParallel(converted)},
            )
    return model
