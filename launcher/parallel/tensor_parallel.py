"""Tensor parallelism of a model part (parallel.tp_size > 1): DTensor `parallelize_module` over the mesh's tp axis.

Per block, q/k/v and the MLP up projection are split column-wise (each rank holds whole heads and
a slice of the hidden width) and o_proj and the MLP down projection row-wise, so one all-reduce
ends each branch. The attention derives its local head count from q_proj's output width, which
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


_STYLES: dict[str, type[ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
HF_SEQUENCE_PARALLEL_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
"""What a transformers decoder layer must hold (Llama and its relatives) for sequence parallelism."""


def _hf_layer_plan(config: Any, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The config's own plan of one decoder layer; with sequence parallelism also its norms and branch inputs."""
    plan = layer_tp_plan(config)
    if not sequence_parallel:
        return {name: _STYLES[style]() for name, style in plan.items()}
    styles: dict[str, ParallelStyle] = {
        name: ColwiseParallel() if style == "colwise" else RowwiseParallel(output_layouts=Shard(1))
        for name, style in plan.items()
    }
    styles.update(
        {
            "input_layernorm": SequenceParallel(),
            "post_attention_layernorm": SequenceParallel(),
            # the attention takes its input as a keyword, the MLP positionally: both gather the sequence,
            # left a DTensor so that backward reduce-scatters the projections' summed input gradients
            # (a plain tensor would all-reduce each projection's)
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=False,
            ),
            "mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False
            ),
        }
    )
    return styles


def _apply_hf(model: HFCausalLM, tp_mesh: DeviceMesh, sequence_parallel: bool) -> nn.Module:
    """Split each decoder layer by the config's own plan, head and embedding over the vocabulary; replicate the rest."""
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model.hf).__name__}: no decoder layers found to split.")
    if sequence_parallel and any(
        not hasattr(layer, n) for layer in layers for n in HF_SEQUENCE_PARALLEL_PARTS
    ):
        raise ValueError(f"{type(model.hf).__name__}: sequence parallelism needs Llama-style decoder layers.")
    for layer in layers:
        parallelize_module(layer, tp_mesh, _hf_layer_plan(model.hf.config, sequence_parallel))
    names = {module: name for name, module in model.named_modules()}
    head, embedding = model.hf.get_output_embeddings(), model.hf.get_input_embeddings()
    _split_head_and_embedding(
        model,
        tp_mesh,
        names.get(head, "hf.lm_head"),
        names.get(embedding, "hf.model.embed_tokens"),
        sequence_parallel=sequence_parallel,
    )
    if sequence_parallel:
        # the residual stream enters the first layer split along the sequence; the final norm leaves it so
        first_layer = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        parallelize_module(layers[0], tp_mesh, first_layer)
        parallelize_module(model.hf.model.norm, tp_mesh, SequenceParallel())
    converted: dict[int, nn.Parameter] = {}
    for module in list(model.modules()):
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            parallelize_module(module, tp_mesh, ReplicateParallel(converted))
    return model


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> nn.Module:
    """Shard the blocks, head and embedding over `tp_mesh`; every other parameter becomes a replicated DTensor."""
    if isinstance(model, HFCausalLM):
        return _apply_hf(model, tp_mesh, sequence_parallel)
    for block in model.blocks:
        parallelize_module(block, tp_mesh, _block_plan(sequence_parallel))
    _split_head_and_embedding(model, tp_mesh, "lm_head", "tok_emb", sequence_parallel=sequence_parallel)
    converted: dict[int, nn.Parameter] = {}
    top: dict[str, ParallelStyle] = {"pos_emb": ReplicateParallel(converted)}
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
