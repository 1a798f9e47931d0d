"""Hugging Face causal LMs as a model option (`model.kind=hf`), built locally: nothing is downloaded.

`model.hf_config` is a preset name or a local directory. A preset (`llama`, `gpt2`) builds a
model with random weights whose shape comes from the model group's own keys (n_layer, d_model,
n_head, d_ff, vocab_size, max_seq_len, dropout, tie_embeddings), so `model=hf_llama_tiny` and the
GPT presets are sized the same way. A directory needs a config.json; weights are loaded from it
when it holds them (safetensors or a PyTorch bin), else initialized from the seed. Remote code is
never run (`trust_remote_code` stays off), in line with configs never naming code to import.

The loop calls `model(input_ids, position_ids) -> logits`: `HFCausalLM` wraps the HF model so it does, with the
key-value cache off (it only serves generation). GPT-2's `Conv1D` projections become `nn.Linear`
(weight transposed) so quantization, LoRA and tensor parallelism treat every family alike.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn

from launcher.groups.model.config import ModelConfig, ff_width, vocab_size

PRESETS = ("llama", "gpt2")
# The linear layers of each preset's blocks, by name suffix (what quantization and LoRA may target).
PRESET_LINEARS = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
}
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _preset_config(cfg: ModelConfig) -> Any:
    """The transformers config of a preset, shaped by the model group's keys."""
    from transformers import GPT2Config, LlamaConfig

    common = {"vocab_size": vocab_size(cfg), "tie_word_embeddings": cfg.tie_embeddings, "use_cache": False}
    common |= {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if cfg.hf_config == "llama":
        return LlamaConfig(
            hidden_size=cfg.d_model, intermediate_size=ff_width(cfg), num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
            max_position_embeddings=cfg.max_seq_len, attention_bias=cfg.bias, mlp_bias=cfg.bias,
            attention_dropout=cfg.dropout, **common,
        )  # fmt: skip
    return GPT2Config(
        n_embd=cfg.d_model, n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=ff_width(cfg),
        n_positions=cfg.max_seq_len, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout, **common,
    )  # fmt: skip


def is_preset(name: str | None) -> bool:
    """Whether `model.hf_config` names a preset rather than a directory."""
    return name in PRESETS


def read_local_config(path: str) -> dict[str, Any]:
    """The raw config.json of a local model directory (no transformers import needed)."""
    return json.loads((Path(path) / "config.json").read_text())


def local_vocab_size(path: str) -> int | None:
    """The vocab_size of a local model directory's config.json; None when it cannot be read."""
    try:
        return int(read_local_config(path)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def has_weights(path: str) -> bool:
    """Whether a local model directory holds weights to load."""
    return any((Path(path) / name).is_file() for name in WEIGHT_FILES)


def hf_config(cfg: ModelConfig) -> Any:
    """The transformers config `cfg` describes, with the key-value cache off."""
    from transformers import AutoConfig

    if is_preset(cfg.hf_config):
        config = _preset_config(cfg)
    else:
        config = AutoConfig.from_pretrained(cfg.hf_config, local_files_only=True, trust_remote_code=False)
    config.use_cache = False
    return config


def conv1d_to_linear(model: nn.Module) -> nn.Module:
    """Replace transformers' Conv1D (y = x @ W + b, W: in x out) by the equivalent nn.Linear."""
    from transformers.pytorch_utils import Conv1D

    for name, module in list(model.named_modules()):
        if isinstance(module, Conv1D):
            in_features, out_features = module.weight.shape
            linear = nn.Linear(in_features, out_features, bias=module.bias is not None, device="meta")
            linear.weight = nn.Parameter(module.weight.detach().t().contiguous())
            if module.bias is not None:
                linear.bias = nn.Parameter(module.bias.detach().clone())
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, linear)
    return model


class HFCausalLM(nn.Module):
    """A transformers causal LM called as the loop calls every model: token ids -> logits."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] -> next-token logits [B, T, vocab_size], without a key-value cache.

        Position ids that restart inside a row make transformers build a block-diagonal (packed
        documents) mask in families that support it (Llama and its relatives).
        """
        return self.hf(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


def build_hf_model(cfg: ModelConfig) -> HFCausalLM:
    """The HF model `cfg` describes, float32 on the CPU; random init depends only on torch's seed."""
    from transformers import AutoModelForCausalLM

    config = hf_config(cfg)
    if not is_preset(cfg.hf_config) and has_weights(cfg.hf_config):
        hf = AutoModelForCausalLM.from_pretrained(
            cfg.hf_config, config=config, local_files_only=True, trust_remote_code=False, dtype=torch.float32
        )
        source = f"weights from {cfg.hf_config}"
    else:
        hf = AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=torch.float32)
        source = "random weights"
    hf.config.use_cache = False
    rows = hf.get_input_embeddings().num_embeddings
    if cfg.resize_embeddings and cfg.vocab_size is not None and cfg.vocab_size != rows:
        hf.resize_token_embeddings(cfg.vocab_size)  # new rows: drawn from the seeded generator, like init
        source += f", token embedding resized {rows} -> {cfg.vocab_size} for the tokenizer"
    if int(os.environ.get("RANK", "0")) == 0:
        Console().print(
            f"model: Hugging Face {type(hf).__name__} ({cfg.hf_config}, {source}); use_cache=False: the "
            "key-value cache only serves generation, so training turns it off",
            soft_wrap=True,
        )
    return HFCausalLM(conv1d_to_linear(hf))


def enable_checkpointing(model: nn.Module, every_n_layers: int = 1) -> bool:
    """Turn on the HF model's own activation checkpointing (non-reentrant); False if `model` is not HF.

    transformers 5 calls it `activation_checkpointing_enable` (`gradient_checkpointing_enable` is
    deprecated there); older releases have only the latter. Inputs are made to require grad so a
    frozen embedding (LoRA) still lets gradients reach the adapters inside checkpointed layers.
    """
    if not isinstance(model, HFCausalLM):
        return False
    hf = model.hf
    kwargs = {"use_reentrant": False}
    if hasattr(hf, "activation_checkpointing_enable"):
        hf.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers
        )
    else:
        if every_n_layers != 1:
            raise ValueError("this transformers release checkpoints every layer only (every_n_layers=1).")
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    hf.enable_input_require_grads()
    return True


def hf_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, 6 * N + 12 * layers * width * seq_len, N counted on the meta device."""
    from transformers import AutoModelForCausalLM

    config = hf_config(cfg)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    num_params = sum(p.numel() for p in hf.parameters())  # a tied matrix is listed once
    return float(6 * num_params + 12 * config.num_hidden_layers * config.hidden_size * seq_len)
