"""The compile group: torch.compile of the model, per transformer block.

Each block of the built-in GPT is compiled in place (`nn.Module.compile`), as torchtitan does,
rather than the whole model: the blocks are identical, so one compiled graph serves them all and
cold compile time is that of one block; parameter names and state-dict keys stay unchanged (no
`_orig_mod.` prefix), so checkpoints load either way; and per-block sharding hooks (FSDP2) stay
between the compiled regions instead of breaking a whole-model graph. Compile comes after
activation checkpointing (the checkpointed forward is traced into the block's graph) and before
the strategy wraps the model. A Hugging Face model's decoder layers are compiled the same way;
models without repeated layers are compiled whole, in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launcher.config.compile import CompileConfig

if TYPE_CHECKING:  # torch only where a model is compiled: the launching process never needs it
    from torch import nn


def compiled_modules(model: nn.Module) -> list[nn.Module]:
    """The modules compiled one by one: the decoder layers (GPT blocks, a transformers model's layers), else the whole model."""
    from launcher.components.model.family import decoder_layers

    layers = decoder_layers(model)
    return list(layers) if layers is not None else [model]


def apply(model: nn.Module, cfg: CompileConfig) -> nn.Module:
    """Compile `model` in place as `cfg` asks (compilation itself happens on the first forward)."""
    if cfg.mode == "off":
        return model
    for module in compiled_modules(model):
        module.compile(mode=cfg.mode, fullgraph=cfg.fullgraph, dynamic=cfg.dynamic)
    return model
