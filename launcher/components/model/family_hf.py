"""The Hugging Face decoder families (`model.kind=hf`, launcher.components.model.hf): the Family verbs for them.

One entry serves every transformers causal LM the launcher builds (Llama, Qwen2, Mistral, Gemma, GPT-2,
...): what differs between them is read from the model itself (its config's own tensor-parallel plan, the
class of its decoder layers, its attention facts in hf_family). torch and transformers are imported inside
the verbs, so the launching process asks which folder shapes a model without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from launcher.components.model.family import TensorParallelPlan
from launcher.components.model.hf_files import is_preset, layer_tp_plan
from launcher.config.model import ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel import ParallelStyle

    from launcher.components.model.shape import ModelShape

HF_PREFIX = "hf."
"""Where HFCausalLM keeps the transformers model: the prefix of its parameter names."""
SEQUENCE_PARALLEL_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
"""What a transformers decoder layer must hold (Llama and its relatives) for sequence parallelism."""


def build(cfg: ModelConfig, *, empty: bool = False, announce: bool = True) -> nn.Module:
    """HFCausalLM around the transformers model `cfg` describes (launcher.components.model.hf.build_hf_model)."""
    from launcher.components.model.hf import build_hf_model

    return build_hf_model(cfg, empty=empty, announce=announce)


def init_on_meta(cfg: ModelConfig) -> bool:
    """No: transformers' init goes through `.data` aliases and in-place arithmetic the replay cannot follow."""
    return False


def from_folder(cfg: ModelConfig) -> bool:
    """Whether model.path names a pretrained folder to start from."""
    return cfg.path is not None


def folder(cfg: ModelConfig) -> str | None:
    """model.path, else a directory hf_config; None for a preset."""
    if cfg.path is not None:
        return cfg.path
    return None if cfg.hf_config is None or is_preset(cfg.hf_config) else cfg.hf_config


def shape(cfg: ModelConfig) -> ModelShape:
    """Measured on a meta-device build (launcher.components.model.shape.hf_shape)."""
    from launcher.components.model.shape import hf_shape

    return hf_shape(cfg)


def source(cfg: ModelConfig) -> str:
    """A preset, or the folder its config.json (and weights, with model.path) come from."""
    where = folder(cfg)
    if where is None:
        return f"Hugging Face preset {cfg.hf_config} (shape from the model keys, random weights)"
    weights = "its weights" if cfg.path is not None else "random weights"
    return f"Hugging Face folder {where} (shape from its config.json, {weights})"


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The ModuleList of the class the transformers model names in `_no_split_modules`."""
    from launcher.components.model.hf import hf_decoder_layers

    return hf_decoder_layers(model)


def checkpointing(model: nn.Module, every_n_layers: int, options: dict | None) -> bool:
    """transformers' own activation checkpointing switch, turned on."""
    from launcher.components.model.hf import hf_checkpointing

    hf_checkpointing(model, every_n_layers, options)
    return True


def _layer_plan(config: Any, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The config's own plan of one decoder layer; with sequence parallelism also its norms and branch inputs."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = layer_tp_plan(config)
    if not sequence_parallel:
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        return {name: styles[style]() for name, style in plan.items()}
    layer: dict[str, ParallelStyle] = {
        name: ColwiseParallel() if style == "colwise" else RowwiseParallel(output_layouts=Shard(1))
        for name, style in plan.items()
    }
    layer.update(
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
    return layer


def tp_plan(model: nn.Module, *, sequence_parallel: bool) -> TensorParallelPlan:
    """Each decoder layer by its config's own plan (a MoE model's routed experts whole); head and embedding where
    the model says they are."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model.hf).__name__}: no decoder layers found to split.")
    if sequence_parallel and any(not hasattr(layer, n) for layer in layers for n in SEQUENCE_PARALLEL_PARTS):
        raise ValueError(f"{type(model.hf).__name__}: sequence parallelism needs Llama-style decoder layers.")
    names = {module: name for name, module in model.named_modules()}
    head, embedding = model.hf.get_output_embeddings(), model.hf.get_input_embeddings()
    from launcher.components.model.hf_local_experts import LocalExperts, local_expert_modules

    # routed experts stay whole on every tp rank, computed on local tensors (hf_local_experts)
    top: dict[str, ParallelStyle] = {name: LocalExperts() for name in local_expert_modules(model)}
    if sequence_parallel:
        # the residual stream enters the first layer split along the sequence; the final norm leaves it so
        top[names[layers[0]]] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        top["hf.model.norm"] = SequenceParallel()
    return TensorParallelPlan(
        layer=_layer_plan(model.hf.config, sequence_parallel),
        head=names.get(head, "hf.lm_head"),
        embedding=names.get(embedding, "hf.model.embed_tokens"),
        top=top,
    )


def ep_plan(model: nn.Module) -> dict[str, ParallelStyle] | None:
    """None: expert parallelism splits transformers' experts modules as launcher.parallel.expert_parallel's sites."""
    return None


def stage(model: nn.Module, layers: range, *, first: bool, last: bool) -> nn.Module:
    """A Llama-style model cut to `layers` (launcher.components.model.hf.hf_stage; ValueError for others)."""
    from launcher.components.model.hf import hf_stage

    return hf_stage(model, layers, first=first, last=last)


def tied_names(cfg: ModelConfig) -> tuple[str, str] | None:
    """The transformers model's token embedding and head, where its config ties them."""
    tied = shape(cfg).equivalent.tie_embeddings
    return (f"{HF_PREFIX}model.embed_tokens.weight", f"{HF_PREFIX}lm_head.weight") if tied else None


def new_cache(model: nn.Module) -> Any:
    """The decode step's key-value cache: one the model's forward with `cache=` fills (its class makes it)."""
    return model.new_cache()


def transformers_prefix() -> str | None:
    """The transformers model sits under `hf.` inside HFCausalLM."""
    return HF_PREFIX


def to_transformers(state: dict[str, torch.Tensor], cfg: ModelConfig) -> Any:
    """The transformers model of the config, holding `state` (Conv1D weights transposed back)."""
    from launcher.components.model.hf_export import hf_to_transformers

    return hf_to_transformers(state, cfg)
