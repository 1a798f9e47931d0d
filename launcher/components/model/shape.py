"""The shape of the model a spec describes, for the planner: counted without building real weights.

The built-in GPT's shape comes from the model group's keys. A Hugging Face model is built on the
meta device from its config (no weights, no memory), so its parameter count and the linear layers
of one decoder layer are exact for any family; the activation model then treats it as the GPT of
the same width, depth and heads, with a gated (SwiGLU) MLP counted as 1.5 times the MLP width,
since it keeps three [tokens x d_ff] tensors for backward where GELU keeps two.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from launcher.config.model import ModelConfig, config_num_params, ff_width


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the planner reads of a model: size, the linear layers of a block, and a GPT-equivalent config."""

    num_params: int
    """Parameters, a tied matrix counted once."""
    block_linears: dict[str, tuple[int, int]]
    """Linear layer of one decoder layer (name inside the layer) -> (in, out) features."""
    equivalent: ModelConfig
    """The built-in GPT config whose activations match this model's (the config itself for kind=gpt)."""


def _gpt_linears(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    d, ff = cfg.d_model, ff_width(cfg)
    return {
        "attn.q_proj": (d, d), "attn.k_proj": (d, d), "attn.v_proj": (d, d), "attn.o_proj": (d, d),
        "mlp.up": (d, ff), "mlp.down": (ff, d),
    }  # fmt: skip


@lru_cache(maxsize=8)
def _hf_shape(cfg: ModelConfig) -> ModelShape:
    from torch import nn  # only a Hugging Face model is built (on the meta device) to be measured

    from launcher.components.model.hf import build_hf_model, decoder_layers
    from launcher.components.model.hf_files import hf_config

    model = build_hf_model(cfg, empty=True, announce=False)
    config = hf_config(cfg)
    layers = decoder_layers(model)
    linears = {
        name: (module.in_features, module.out_features)
        for name, module in (layers[0].named_modules() if layers is not None else [])
        if isinstance(module, nn.Linear)
    }
    gated = any(name.endswith("gate_proj") for name in linears)
    width = (
        getattr(config, "intermediate_size", None)
        or getattr(config, "n_inner", None)
        or 4 * config.hidden_size
    )
    rows = model.hf.get_input_embeddings().num_embeddings
    equivalent = dataclasses.replace(
        cfg,
        kind="gpt", path=None, hf_config=None, n_layer=config.num_hidden_layers, d_model=config.hidden_size,
        n_head=config.num_attention_heads, d_ff=int(width * 1.5) if gated else width, vocab_size=rows,
        dropout=float(getattr(config, "attention_dropout", 0.0) or getattr(config, "resid_pdrop", 0.0) or 0.0),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
    )  # fmt: skip
    num_params = sum(p.numel() for p in model.parameters())
    return ModelShape(num_params=num_params, block_linears=linears, equivalent=equivalent)


def model_shape(cfg: ModelConfig) -> ModelShape:
    """The shape of the model `cfg` describes (a Hugging Face one is built on the meta device once)."""
    if cfg.kind == "hf":
        return _hf_shape(cfg)
    return ModelShape(num_params=config_num_params(cfg), block_linears=_gpt_linears(cfg), equivalent=cfg)
