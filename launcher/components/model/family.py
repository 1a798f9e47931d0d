"""The model-family seam: what a family module offers, and how code reaches the family of a config or a model.

`launcher.config.model.FAMILIES` maps model.kind to the module implementing that family (the built-in
GPT: `family_gpt`; Hugging Face decoders: `family_hf`), imported only when a run chooses it, as the
backends of `launch.BACKENDS` are. Everything that differs between families (how a model is built, its
decoder layers, how tensor parallelism splits it, where a pipeline cuts it, what the planner counts, how
it becomes a transformers model) is a verb of `Family`, so parallelism, the planner and the tools ask
the family and never which family they hold. Code with a built model and no config asks `family_of(model)`:
each family's model class names its family in the class attribute `model_family` (kept by FSDP2's
wrapper class, by peft's in-place injection and by `torch.compile` of its layers).

A family's decode step is its model's own forward over the new tokens with a key-value cache
(`forward(ids, position_ids, cache=, attention_mask=)`, so FSDP2's and TP's hooks apply as in training);
`new_cache` is the verb that makes the cache (launcher.components.model.generation asks it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from launcher.config.model import FAMILIES, ModelConfig

if TYPE_CHECKING:  # torch only where a model is built: the launching process asks a GPT config without it
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel import ParallelStyle


@dataclass(frozen=True, kw_only=True)
class TensorParallelPlan:
    """How tensor parallelism splits a model of the family (launcher.parallel.tensor_parallel applies it)."""

    layer: dict[str, ParallelStyle]
    """Module path inside one decoder layer -> its style (q/k/v column-wise, the branch outputs row-wise)."""
    head: str
    """Path of the LM head, split column-wise over the vocabulary (absent on an earlier pipeline stage)."""
    embedding: str
    """Path of the token embedding, split row-wise over the vocabulary (absent on a later pipeline stage)."""
    top: dict[str, ParallelStyle] = field(default_factory=dict)
    """Module path in the model -> style, applied after the layers (sequence parallelism: the first layer's
    input split along the sequence, the final norm on the shard); paths a stage lacks are skipped."""


class Family(Protocol):
    """The verbs a family module offers (module-level functions of the module FAMILIES names)."""

    def build(self, cfg: ModelConfig, *, empty: bool = False, announce: bool = True) -> nn.Module:
        """The model `cfg` describes, float32 on the CPU, init from torch's global seed; `empty`: parameters on
        the meta device, for weights loaded after sharding (only where `from_folder`); `announce`: rank 0 says
        where the weights came from."""
        ...

    def init_on_meta(self, cfg: ModelConfig) -> bool:
        """Whether a build on the meta device can regenerate its initial values into the shards
        (launcher.components.model.meta_init; on_meta decides which runs take it)."""
        ...

    def from_folder(self, cfg: ModelConfig) -> bool:
        """Whether the weights come from a folder (a pretrained start; a frozen reference or teacher copy reads it)."""
        ...

    def folder(self, cfg: ModelConfig) -> str | None:
        """The local folder whose config.json shapes the model (None: the model keys shape it)."""
        ...

    def shape(self, cfg: ModelConfig) -> Any:
        """What the planner counts, a launcher.components.model.shape.ModelShape (parameters, one layer's linears,
        the GPT-equivalent config, per-layer widths; typed Any: shape.model_shape asks this verb)."""
        ...

    def source(self, cfg: ModelConfig) -> str:
        """Where the model comes from, for the dry run's model line."""
        ...

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList | None:
        """The repeated decoder layers (FSDP shards, compile traces and TP splits them one by one); None: none found."""
        ...

    def checkpointing(self, model: nn.Module, every_n_layers: int, options: dict | None) -> bool:
        """Turn on the family's own activation checkpointing; False where the launcher wraps the layers itself."""
        ...

    def tp_plan(self, model: nn.Module, *, sequence_parallel: bool) -> TensorParallelPlan:
        """How tensor parallelism splits this model (ValueError naming what it lacks where it cannot)."""
        ...

    def ep_plan(self, model: nn.Module) -> dict[str, ParallelStyle] | None:
        """Expert parallelism's plan (module path -> style over the ep axis); None for a family without experts."""
        ...

    def stage(self, model: nn.Module, layers: range, *, first: bool, last: bool) -> nn.Module:
        """Keep `layers` under their whole-model names (and the embedding if first, the norm and head if last)."""
        ...

    def tied_names(self, cfg: ModelConfig) -> tuple[str, str] | None:
        """Parameter names of the tied embedding and head (a pipeline keeps one copy on each end), or None."""
        ...

    def new_cache(self, model: nn.Module) -> Any:
        """An empty key-value cache for the decode step: the model's forward with `cache=` fills it."""
        ...

    def transformers_prefix(self) -> str | None:
        """Where a transformers model sits inside ours (its keys' prefix); None when the model is not one."""
        ...

    def to_transformers(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> Any:
        """A transformers causal LM (float32, eval, key-value cache on) holding `state`, for export."""
        ...


def family(cfg: ModelConfig) -> Family:
    """The family module of `cfg.kind`, imported on demand."""
    if cfg.kind not in FAMILIES:
        raise ValueError(f"model.kind={cfg.kind!r} is not a model family: use one of {', '.join(FAMILIES)}.")
    return cast(Family, importlib.import_module(FAMILIES[cfg.kind]))


def _family_name(model: nn.Module) -> str | None:
    """The FAMILIES key a model's class names (DeepSpeed's engine: its module's), or None."""
    inner = getattr(model, "module", None)
    name = getattr(model, "model_family", None) or getattr(inner, "model_family", None)
    return name if name in FAMILIES else None


def family_of(model: nn.Module) -> Family:
    """The family of a built model, by its class attribute `model_family`."""
    name = _family_name(model)
    if name is None:
        raise ValueError(
            f"{type(model).__name__} names no model family: its class needs `model_family`, a key of "
            f"launcher.config.model.FAMILIES ({', '.join(FAMILIES)})."
        )
    return cast(Family, importlib.import_module(FAMILIES[name]))


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The repeated decoder layers of any family's model; None where its family finds none or it has no family."""
    return None if _family_name(model) is None else family_of(model).decoder_layers(model)
