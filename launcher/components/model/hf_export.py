"""A trained model's full state dict as a transformers causal LM that `save_pretrained` writes.

The two built-in families' mappings (the keys of `build_model(cfg).state_dict()`); `to_transformers` asks
the model's family (launcher.components.model.family), whose `to_transformers` verb calls one of these:

- `kind=hf`: the transformers model under an `hf.` prefix, GPT-2's Conv1D projections stored as
  nn.Linear (weight transposed, see `hf.conv1d_to_linear`). The prefix is stripped, Conv1D weights
  are transposed back, and the model is built from `hf_files.hf_config(cfg)`.
- `kind=gpt` (the built-in decoder): the same computation as transformers' GPT-2, so it becomes a
  `GPT2LMHeadModel`: q/k/v concatenated into `c_attn`, Linear weights in Conv1D layout, zero
  biases where the model has none, the tanh GELU (`gelu_new`), nn.LayerNorm's epsilon (1e-5).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from launcher.config.model import ModelConfig, ff_width, vocab_size

HF_PREFIX = "hf."
LAYER_NORM_EPS = 1e-5
"""nn.LayerNorm's default epsilon, which the built-in GPT uses."""


def gpt2_config(cfg: ModelConfig) -> Any:
    """The transformers GPT2Config that computes what the built-in GPT of `cfg` computes (no dropout)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size(cfg), n_positions=cfg.max_seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_inner=ff_width(cfg), activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=LAYER_NORM_EPS,
        tie_word_embeddings=cfg.tie_embeddings, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip


def hf_export_problem(cfg: ModelConfig) -> str | None:
    """Why the model `cfg` describes has no transformers class to be exported to; None when it has one."""
    if cfg.kind != "gpt" or cfg.moe.num_experts == 0:
        return None
    return (
        f"--format hf: model.moe.num_experts={cfg.moe.num_experts}: the built-in GPT with MoE blocks has no "
        "transformers class (it exports as GPT-2, which has no experts), so no Hugging Face folder would load "
        "it. Export the checkpoint's native format instead: `train-export SOURCE OUT.pt` (--format pt, the "
        "default; add --merge after LoRA or nf4), a state dict that `build_model(spec.model)` loads at world "
        "size 1."
    )


def _bias(state: dict[str, torch.Tensor], key: str, width: int) -> torch.Tensor:
    """`state[key]`, or zeros of `width` where the model was built without biases."""
    return state[key] if key in state else torch.zeros(width)


def gpt_to_gpt2_state(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The built-in GPT's state dict in GPT2LMHeadModel's names and Conv1D (in x out) layout."""
    d, ff = cfg.d_model, ff_width(cfg)
    out = {
        "transformer.wte.weight": state["tok_emb.weight"],
        "transformer.wpe.weight": state["pos_emb.weight"],
        "transformer.ln_f.weight": state["norm_f.weight"],
        "transformer.ln_f.bias": _bias(state, "norm_f.bias", d),
        "lm_head.weight": state["lm_head.weight"],
    }
    for i in range(cfg.n_layer):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        qkv = [f"{src}attn.{p}_proj" for p in "qkv"]
        out[f"{dst}attn.c_attn.weight"] = torch.cat([state[f"{k}.weight"] for k in qkv]).t()
        out[f"{dst}attn.c_attn.bias"] = torch.cat([_bias(state, f"{k}.bias", d) for k in qkv])
        pairs = {"attn.c_proj": ("attn.o_proj", d), "mlp.c_fc": ("mlp.up", ff), "mlp.c_proj": ("mlp.down", d)}
        for name, (ours, width) in pairs.items():
            out[f"{dst}{name}.weight"] = state[f"{src}{ours}.weight"].t()
            out[f"{dst}{name}.bias"] = _bias(state, f"{src}{ours}.bias", width)
        for name, ours in (("ln_1", "norm_attn"), ("ln_2", "norm_mlp")):
            out[f"{dst}{name}.weight"] = state[f"{src}{ours}.weight"]
            out[f"{dst}{name}.bias"] = _bias(state, f"{src}{ours}.bias", d)
    return {k: v.contiguous() for k, v in out.items()}


def hf_state(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A `kind=hf` state dict in `model`'s own names and layouts: prefix stripped, Conv1D weights transposed back."""
    from transformers.pytorch_utils import Conv1D

    conv1d = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Conv1D)}
    out = {}
    for key, value in state.items():
        name = key.removeprefix(HF_PREFIX)
        out[name] = value.t().contiguous() if name in conv1d else value
    return out


def _as_cpu_float(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` on the CPU, floating tensors in float32."""
    return {k: v.detach().to("cpu", torch.float32) if v.is_floating_point() else v for k, v in state.items()}


def _finished(model: Any, converted: dict[str, torch.Tensor]) -> Any:
    """`model` holding `converted` (loaded strictly), eval, with its key-value cache on again."""
    model.load_state_dict(converted, strict=True)
    model.config.use_cache = True  # training turned it off; generation wants it
    return model.eval()


def gpt_to_transformers(state: dict[str, torch.Tensor], cfg: ModelConfig) -> Any:
    """The built-in GPT's state as the GPT2LMHeadModel computing the same (float32, eval, cache on)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(gpt2_config(cfg), trust_remote_code=False, dtype=torch.float32)
    return _finished(model, gpt_to_gpt2_state(_as_cpu_float(state), cfg))


def hf_to_transformers(state: dict[str, torch.Tensor], cfg: ModelConfig) -> Any:
    """A `kind=hf` state as the transformers model of `hf_files.hf_config(cfg)` (float32, eval, cache on)."""
    from transformers import AutoModelForCausalLM

    from launcher.components.model.hf_files import hf_config

    model = AutoModelForCausalLM.from_config(hf_config(cfg), trust_remote_code=False, dtype=torch.float32)
    converted = hf_state(_as_cpu_float(state), model)
    rows = converted[_embedding_key(model)].shape[0]
    if rows != model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(rows)  # a tokenizer-sized embedding (model.resize_embeddings)
    return _finished(model, converted)


def to_transformers(state: dict[str, torch.Tensor], cfg: ModelConfig) -> Any:
    """A transformers causal LM (float32, eval, key-value cache on) holding `state`, as the model's family exports it."""
    from launcher.components.model.family import family

    return family(cfg).to_transformers(state, cfg)


def _embedding_key(model: nn.Module) -> str:
    """The state-dict key of `model`'s input embedding matrix."""
    embedding = model.get_input_embeddings()
    return next(f"{name}.weight" for name, m in model.named_modules() if m is embedding)
