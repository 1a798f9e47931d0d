"""Tiny Hugging Face models with random weights, saved with `save_pretrained`: the tests' "pretrained" folders."""

from __future__ import annotations

from pathlib import Path

import torch

ARCHITECTURES = ("llama", "qwen2", "gpt2")


def hf_config(arch: str, vocab_size: int = 256):
    """A tiny transformers config of `arch` (grouped-query attention where the family has it, no dropout).

    qwen2's head is tied to its embedding, as in the small Qwen2 models; llama's is not.
    """
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    if arch == "gpt2":
        return GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=vocab_size, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
    family = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    return family(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, vocab_size=vocab_size,
        tie_word_embeddings=arch == "qwen2", use_cache=False,
    )  # fmt: skip


def make_hf_model(arch: str, out: Path, seed: int = 1234) -> Path:
    """Save a tiny `arch` model with seeded random weights to `out` (config.json + model.safetensors)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
    model.save_pretrained(out)
    return out


def make_sentencepiece_llama(
    out: Path, *, tokenizer_config: bool = True, hidden_size: int = 64, seed: int = 1234
) -> Path:
    """A tiny Llama folder as published ones look: config.json, safetensors weights and a SentencePiece
    tokenizer.model (with or without tokenizer_config.json), the embedding sized to the tokenizer."""
    from data_assets import make_sentencepiece_tokenizer
    from transformers import AutoModelForCausalLM

    make_sentencepiece_tokenizer(out, config=tokenizer_config)
    config = hf_config("llama", vocab_size=512)
    config.hidden_size, config.intermediate_size = hidden_size, 2 * hidden_size
    config.head_dim = hidden_size // config.num_attention_heads
    config.bos_token_id, config.eos_token_id = 1, 2
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out
