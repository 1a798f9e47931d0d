"""The model group's schema, and the size formulas that need only the config (no model is built)."""

from __future__ import annotations

from dataclasses import dataclass, field

from launcher.config.moe import MoEConfig, num_moe_blocks

ATTENTION = ("auto", "sdpa", "varlen", "flex", "flash_attention_2")
"""model.attention's options (launcher.components.model.attention); flash_attention_2: a Hugging Face model's
flash_attn kernels, where the rules accept it (launcher.rules.flash)."""

FAMILIES: dict[str, str] = {
    "gpt": "launcher.components.model.family_gpt",
    "hf": "launcher.components.model.family_hf",
}
"""model.kind -> the module implementing that model family (launcher.components.model.family.Family), imported
when chosen; its keys are model.kind's options."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to train and its shape."""

    kind: str = "gpt"
    """Model family, a key of FAMILIES: `gpt` (the built-in decoder) or `hf` (a Hugging Face causal LM)."""
    path: str | None = None
    """kind=hf: a local Hugging Face model folder (config.json + safetensors weights) to start from; nothing is downloaded."""
    hf_config: str | None = None
    """kind=hf without path: a preset (llama, gpt2) or a local directory with config.json; random weights."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block (d_model must be a multiple of it)."""
    d_model: int = 128
    """Width of the residual stream."""
    d_ff: int | None = None
    """Hidden width of the MLP; null means 4 * d_model."""
    vocab_size: int | None = None
    """Token ids the embedding holds; null: the tokenizer's size padded to a multiple of 64 (256 for bytes)."""
    max_seq_len: int = 256
    """Context length (the learned positional embedding has this many rows)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches."""
    tie_embeddings: bool = True
    """Share one matrix between the token embedding and the output projection."""
    bias: bool = False
    """Give linear layers and LayerNorms a bias."""
    resize_embeddings: bool = False
    """kind=hf from a directory: resize its token embedding (and head) to the tokenizer (model.vocab_size)."""
    attention: str = "auto"
    """Packed documents: sdpa (dense [B,1,T,T] mask), varlen (SDPA per document span), flex (FlexAttention
    block mask, CUDA), auto (flex on CUDA, varlen elsewhere; plain causal SDPA when nothing is packed),
    flash_attention_2 (HF models on CUDA with the flash_attn package, bf16/fp16)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """kind=gpt: mixture-of-experts blocks (model.moe.num_experts > 0); the default keeps every block dense."""


BYTE_VOCAB = 256


def vocab_size(cfg: ModelConfig) -> int:
    """The embedding's rows: model.vocab_size (the launcher fills it from the tokenizer; bytes need 256)."""
    return cfg.vocab_size if cfg.vocab_size is not None else BYTE_VOCAB


def ff_width(cfg: ModelConfig) -> int:
    """The MLP hidden width the config asks for."""
    return cfg.d_ff if cfg.d_ff is not None else 4 * cfg.d_model


def expert_width(cfg: ModelConfig) -> int:
    """Each expert MLP's hidden width: model.moe.d_ff, else the dense MLP's."""
    return cfg.moe.d_ff if cfg.moe.d_ff is not None else ff_width(cfg)


def _mlp_params(d: int, ff: int, bias: int) -> int:
    """Parameters of one up-GELU-down MLP of hidden width `ff`."""
    return 2 * d * ff + (ff + d) * bias


def _moe_mlp_params(cfg: ModelConfig, experts: int) -> int:
    """Parameters of one MoE block's feed-forward part holding `experts` routed experts (router, shared MLP)."""
    d, ff, moe = cfg.d_model, expert_width(cfg), cfg.moe
    shared = _mlp_params(d, moe.shared_experts * ff, int(cfg.bias)) if moe.shared_experts else 0
    return d * moe.num_experts + experts * 2 * d * ff + shared


def config_num_params(cfg: ModelConfig, *, active: bool = False) -> int:
    """Parameters of the GPT the config describes, computed without building it (tied matrix once);
    `active`: those one token runs through (top_k of each MoE block's experts)."""
    d, bias = cfg.d_model, int(cfg.bias)
    norm = d * (1 + bias)
    attn = 4 * d * d + 4 * d * bias
    block = 2 * norm + attn + _mlp_params(d, ff_width(cfg), bias)
    num_moe = num_moe_blocks(cfg.moe, cfg.n_layer)
    experts = cfg.moe.top_k if active else cfg.moe.num_experts
    moe_block = 2 * norm + attn + _moe_mlp_params(cfg, experts) if num_moe else 0
    embeddings = vocab_size(cfg) * d + cfg.max_seq_len * d
    head = 0 if cfg.tie_embeddings else vocab_size(cfg) * d
    return embeddings + (cfg.n_layer - num_moe) * block + num_moe * moe_block + norm + head
