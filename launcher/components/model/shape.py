"""The shape of the model a spec describes, for the planner: counted without building real weights.

The built-in GPT's shape comes from the model group's keys. A Hugging Face model is built on the
meta device from its config (no weights, no memory), so its parameter count and the linear layers
of one decoder layer are exact for any family; the activation model then treats it as the GPT of
the same width, depth and heads, with a gated (SwiGLU) MLP counted as 1.5 times the MLP width
(three matmuls of d_model x d_ff where the GPT's MLP has two). A Llama-style layer (RMSNorm, gated
MLP) also carries its own widths (`LlamaLayer`), from which the planner counts its saved tensors
one by one instead. A Mixture-of-Experts model counts its active parameters too (the routed experts a
token reaches, for MFU), and its MLP as the gated experts a token runs through.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from launcher.config.model import ModelConfig, config_num_params, expert_width, ff_width, vocab_size
from launcher.config.moe import num_moe_blocks


@dataclass(frozen=True, kw_only=True)
class LlamaLayer:
    """The widths of a Llama-style decoder layer (RMSNorm, rotary positions, gated MLP) that its saved tensors have."""

    q_width: int
    """Output features of q_proj: query heads x head dim."""
    kv_width: int
    """Output features of k_proj and v_proj: key-value heads x head dim (less than q_width under GQA)."""
    ff_width: int
    """Output features of gate_proj and up_proj: the MLP's intermediate size."""
    head_dim: int
    """Features per attention head (the rotary tables' width)."""


@dataclass(frozen=True, kw_only=True)
class ExpertShape:
    """A Mixture-of-Experts model's routed experts, as the planner splits and routes them."""

    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts each token is routed to."""
    num_layers: int
    """Layers holding routed experts."""
    num_params: int
    """Parameters of every layer's routed experts (stacked weights and their biases)."""
    outside_layers: int
    """Parameters outside the decoder layers (embeddings, final norm, head): FSDP2's root group."""
    width: int = 0
    """Each expert's hidden width."""
    gated: bool = False
    """Whether an expert is a gated MLP (SiLU(gate) x up: its fused gate_up output is twice the width)."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the planner reads of a model: size, the linear layers of a block, and a GPT-equivalent config."""

    num_params: int
    """Parameters, a tied matrix counted once."""
    block_linears: dict[str, tuple[int, int]]
    """Linear layer of one decoder layer (name inside the layer) -> (in, out) features."""
    equivalent: ModelConfig
    """The built-in GPT config whose activations match this model's (the config itself for kind=gpt)."""
    llama_layer: LlamaLayer | None = None
    """A Llama-style decoder layer's widths (None: the GPT or another family, counted as `equivalent`)."""
    num_active_params: int | None = None
    """Parameters one token runs through: a Mixture-of-Experts model's total less the experts it is not routed
    to (what MFU counts); None: every parameter (a dense model)."""
    experts: ExpertShape | None = None
    """The routed experts of a Mixture-of-Experts model (None: a dense model)."""


def _gpt_linears(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    d, ff = cfg.d_model, ff_width(cfg)
    return {
        "attn.q_proj": (d, d), "attn.k_proj": (d, d), "attn.v_proj": (d, d), "attn.o_proj": (d, d),
        "mlp.up": (d, ff), "mlp.down": (ff, d),
    }  # fmt: skip


def _gpt_experts(cfg: ModelConfig) -> ExpertShape | None:
    """The built-in GPT's routed experts (None without model.moe)."""
    layers = num_moe_blocks(cfg.moe, cfg.n_layer) if cfg.moe.num_experts > 0 else 0
    if not layers:
        return None
    d = cfg.d_model
    head = 0 if cfg.tie_embeddings else vocab_size(cfg) * d
    return ExpertShape(
        num_experts=cfg.moe.num_experts,
        top_k=cfg.moe.top_k,
        num_layers=layers,
        num_params=layers * cfg.moe.num_experts * 2 * d * expert_width(cfg),
        outside_layers=(vocab_size(cfg) + cfg.max_seq_len) * d + d * (1 + int(cfg.bias)) + head,
        width=expert_width(cfg),
    )


def gpt_shape(cfg: ModelConfig) -> ModelShape:
    """The built-in GPT's shape, from the model keys."""
    return ModelShape(
        num_params=config_num_params(cfg),
        block_linears=_gpt_linears(cfg),
        equivalent=cfg,
        num_active_params=config_num_params(cfg, active=True),
        experts=_gpt_experts(cfg),
    )


@lru_cache(maxsize=8)
def hf_shape(cfg: ModelConfig) -> ModelShape:
    """A Hugging Face model's shape, measured on a meta-device build of it (cached per config)."""
    from torch import nn  # only a Hugging Face model is built (on the meta device) to be measured

    from launcher.components.model.hf import build_hf_model, hf_decoder_layers
    from launcher.components.model.hf_experts import active_parameters, experts_per_token, is_expert_parameter
    from launcher.components.model.hf_files import hf_config

    model = build_hf_model(cfg, empty=True, announce=False)
    config = hf_config(cfg)
    layers = hf_decoder_layers(model)
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
    experts = sum(p.numel() for name, p in model.named_parameters() if is_expert_parameter(name))
    if experts:  # a token's MLP activations: the gated experts it is routed to
        gated, width = (
            True,
            experts_per_token(config) * (getattr(config, "moe_intermediate_size", None) or width),
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
    return ModelShape(
        num_params=num_params,
        num_active_params=active_parameters(num_params, experts, config) if experts else None,
        block_linears=linears,
        equivalent=equivalent,
        llama_layer=_llama_layer(layers[0], linears, config) if layers is not None else None,
        experts=_hf_experts(model, layers, config, num_params) if experts else None,
    )


def _hf_experts(model: Any, layers: Any, config: Any, num_params: int) -> ExpertShape:
    """A transformers MoE model's routed experts, counted on its meta-device build."""
    from launcher.components.model.hf_experts import experts_per_token, is_expert_parameter, num_experts

    sites = {name.rsplit(".", 1)[0] for name, _ in model.named_parameters() if is_expert_parameter(name)}
    in_layers = sum(p.numel() for p in layers.parameters()) if layers is not None else 0
    return ExpertShape(
        num_experts=num_experts(config),
        top_k=experts_per_token(config),
        num_layers=len(sites),
        num_params=sum(p.numel() for name, p in model.named_parameters() if is_expert_parameter(name)),
        outside_layers=num_params - in_layers,
        width=getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", 0),
        gated=True,  # the families of hf_experts.MOE_FAMILIES: fused gate_up_proj
    )


def _llama_layer(layer: Any, linears: dict[str, tuple[int, int]], config: Any) -> LlamaLayer | None:
    """The widths of `layer` if it is Llama-style (RMSNorm norms, q/k/v/o and gate/up/down projections), else None."""
    names = ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    if any(n not in linears for n in names) or any(not type(m).__name__.endswith("RMSNorm") for m in norms):
        return None
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return LlamaLayer(
        q_width=linears["self_attn.q_proj"][1],
        kv_width=linears["self_attn.k_proj"][1],
        ff_width=linears["mlp.gate_proj"][1],
        head_dim=head_dim,
    )


def model_shape(cfg: ModelConfig) -> ModelShape:
    """The shape of the model `cfg` describes, as its family counts it (launcher.components.model.family)."""
    from launcher.components.model.family import family

    return family(cfg).shape(cfg)
