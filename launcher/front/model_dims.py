"""A Hugging Face folder model's real shape: written into the spec and shown by the dry run.

For `model=hf` with model.path=DIR or model.hf_config=DIR, the folder's config.json decides the
shape and the build ignores the model group's n_layer, d_model, n_head, d_ff, max_seq_len and
tie_embeddings, which would otherwise keep the preset's values (4 / 128 / 4 / ...) in spec.yaml.
ModelConfig types them as numbers (null is not allowed) and no rule refuses them for a Hugging
Face model, so they are filled with the folder's own values (model.vocab_size is already the
folder's, launcher.front.vocab). The fill runs before the rules: they judge the model that
trains (data.seq_len against the folder's max_position_embeddings, not the preset's 256), and
spec.yaml holds it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig

from launcher.components.model.family import family
from launcher.components.model.hf_files import hf_config, local_dir
from launcher.components.model.shape import model_shape
from launcher.config.model import ModelConfig, ff_width, vocab_size
from launcher.front.config_values import typed, with_values


def folder_dims(cfg: ModelConfig) -> dict[str, Any] | None:
    """The model keys a folder's config.json decides, with its values; None for a GPT or a preset."""
    if local_dir(cfg) is None:
        return None
    try:
        config = hf_config(cfg)
    except (OSError, ValueError, KeyError):
        return None  # launcher.rules.hf_model says what is wrong with the folder
    hidden = config.hidden_size
    width = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    dims: dict[str, Any] = {
        "n_layer": config.num_hidden_layers,
        "d_model": hidden,
        "n_head": config.num_attention_heads,
        "d_ff": int(width),
        "tie_embeddings": bool(getattr(config, "tie_word_embeddings", True)),
    }
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int):
        dims["max_seq_len"] = positions
    return dims


def fill_folder_dims(cfg: DictConfig) -> DictConfig:
    """The config with a folder model's real shape filled in (spec.yaml then holds it)."""
    model = typed(cfg, "model")
    dims = folder_dims(model) if model is not None else None
    return with_values(cfg, {f"model.{key}": value for key, value in (dims or {}).items()})


def describe_model(cfg: ModelConfig) -> str:
    """One line for the dry run: where the model comes from, its real dimensions and parameter count."""
    shape = model_shape(cfg)
    folder = local_dir(cfg)
    source = family(cfg).source(cfg)
    dims = folder_dims(cfg) or {}
    real = dataclasses.replace(cfg, **dims)
    heads = f"{real.n_head} heads"
    if folder is not None:
        kv = getattr(hf_config(cfg), "num_key_value_heads", None)
        heads += f" ({kv} key-value)" if kv and kv != real.n_head else ""
    rows = vocab_size(shape.equivalent)  # a folder's embedding rows, as its family measured them
    active = shape.num_active_params
    routed = (
        "" if active is None else f", {active:,} active per token ({active / 1e6:,.2f}M: MFU counts these)"
    )
    return (
        f"model: {source}: {real.n_layer} layers, d_model {real.d_model}, {heads}, d_ff {ff_width(real)}, "
        f"vocab_size {rows}, max_seq_len {real.max_seq_len}; {shape.num_params:,} parameters "
        f"({shape.num_params / 1e6:,.2f}M){routed}"
    )
