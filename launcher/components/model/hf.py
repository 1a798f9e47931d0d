"""Hugging Face causal LMs as a model option (`model.kind=hf`), built locally: nothing is downloaded.

`model.path` names a local Hugging Face model folder (config.json + safetensors or PyTorch
weights, sharded or not): training starts from its weights. Without it, `model.hf_config` is a
preset or a local directory whose config.json shapes a model with random weights; a preset
(`llama`, `gpt2`) takes its shape from the model group's own keys (n_layer, d_model, n_head, d_ff,
vocab_size, max_seq_len, dropout, tie_embeddings), so `model=hf_llama_tiny` and the GPT presets are
sized the same way. Remote code is never run (`trust_remote_code` stays off), in line with configs
never naming code to import.

The loop calls `model(input_ids, position_ids) -> logits`: `HFCausalLM` wraps the HF model so it
does, with the key-value cache off (it only serves generation). GPT-2's `Conv1D` projections become
`nn.Linear` (weight transposed) so quantization, LoRA and tensor parallelism treat every family
alike. `build_hf_model(cfg, empty=True)` builds the same module with its parameters on the meta
device (buffers real), for strategies that shard first and then receive the weights
(launcher.parallel.pretrained).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Any, ClassVar

import torch
from rich.console import Console
from torch import nn

from launcher.components.files.safe_load import refusing_folder
from launcher.components.model.hf_attention import hf_implementation
from launcher.components.model.hf_experts import router_aux_coef
from launcher.components.model.hf_family import FamilyAttention, family_attention
from launcher.components.model.hf_files import hf_config
from launcher.components.model.long_context import loss_chunk_count
from launcher.components.model.loss import HeadOutputs
from launcher.config.model import ModelConfig


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


SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config keys of families whose head does more than project (their loss stays whole: chunking is bypassed)."""


class HFCausalLM(nn.Module):
    """A transformers causal LM called as the loop calls every model: token ids -> logits."""

    model_family: ClassVar[str] = "hf"
    """Its key in launcher.config.model.FAMILIES (launcher.components.model.family.family_of reads it)."""

    def __init__(self, hf: nn.Module, attention: str = "auto") -> None:
        super().__init__()
        self.hf = hf
        self.attention = attention
        """model.attention: how packed documents are kept apart (launcher.components.model.attention)."""
        self.loss_chunks = "1"
        """train.loss_chunks of the run (auto or a count); 1 returns logits."""
        self.pipeline_stage = False
        """Set on a pipeline stage (hf_stage): the forward walks the parts this stage holds."""
        self.family: FamilyAttention = family_attention(hf.config, type(hf))
        """How this family attends (which of the launcher's attention paths reproduce it)."""
        self.router_aux_coef = router_aux_coef(hf.config) if _balancing_loss(hf) else 0.0
        """Weight of the router's load-balancing loss (config.json's output_router_logits, router_aux_loss_coef)."""
        self.router_aux_loss: torch.Tensor | None = None
        """The last training forward's load-balancing loss (read once by launcher.rank.router_loss), else None."""

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | HeadOutputs:
        """Token ids [B, T] -> next-token logits [B, T, vocab_size]; a key-value cache only when given one.

        Position ids that restart inside a row mark packed documents: sdpa has transformers build its
        own block-diagonal masks (sliding windows included; eager where the family has no SDPA), varlen
        runs attention per document through a registered function, flex uses transformers' FlexAttention.
        With a chunked loss it returns HeadOutputs (final hidden states and the head) instead. With a
        `cache` (new_cache) it decodes through transformers' own cache: `position_ids` are the new
        tokens' positions and `attention_mask` [B, T_seen] marks the real tokens (left padding).
        """
        if cache is not None:
            return self._decode(input_ids, position_ids, cache, attention_mask)
        impl = hf_implementation(
            self.attention,
            self.family,
            packed=position_ids is not None,
            device_type=input_ids.device.type,
            seq_len=input_ids.shape[-1],
        )
        if self.hf.config._attn_implementation != impl:
            self.hf.set_attn_implementation(impl)
        if self.pipeline_stage:
            return self._stage_forward(input_ids, position_ids)
        routed = {"output_router_logits": True} if self.router_aux_coef and self.training else {}
        chunks = loss_chunk_count(self.loss_chunks, tokens=input_ids.numel(), vocab=self.hf.config.vocab_size)
        if chunks > 1 and not any(getattr(self.hf.config, key, None) for key in SCALED_LOGITS):
            hidden = self.hf.base_model(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, **routed
            )
            self._keep_router_loss(hidden)
            return HeadOutputs(hidden.last_hidden_state, self.hf.get_output_embeddings(), chunks)
        out = self.hf(input_ids=input_ids, position_ids=position_ids, use_cache=False, **routed)
        self._keep_router_loss(out)
        return out.logits

    def _keep_router_loss(self, out: Any) -> None:
        """Keep the load-balancing loss of this forward's router logits (transformers' own function of the family)."""
        logits = getattr(out, "router_logits", None)
        if not (self.router_aux_coef and self.training and logits):
            return
        balancing = _balancing_loss(self.hf)
        self.router_aux_loss = balancing(logits, self.hf.num_experts, self.hf.num_experts_per_tok, None)

    def new_cache(self) -> Any:
        """An empty transformers DynamicCache for this model (sliding-window layers as its config says)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.hf.config)

    def _decode(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        cache: Any,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The new tokens through the wrapped model with its cache (dense attention): logits [B, T_new, vocab]."""
        if self.pipeline_stage:
            raise ValueError("decoding with a key-value cache needs the whole model, not a pipeline stage.")
        if self.hf.config._attn_implementation != self.family.dense:
            self.hf.set_attn_implementation(self.family.dense)
        out = self.hf(
            input_ids=input_ids, attention_mask=mask, position_ids=position_ids, cache=cache,
            use_cache=True,
        )  # fmt: skip
        return out.logits

    def _stage_forward(self, inputs: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """A stage: token ids or the previous stage's hidden states in, hidden states or logits out.

        It repeats the family's own forward (masks per layer kind, rotary tables, layers, norm, head,
        final softcap) over the parts this stage holds, so every stage builds the same masks and
        position tables from the positions (checked per family: hf_family.PIPELINE_FAMILIES).
        """
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        base = self.hf.model
        config = base.config
        hidden = inputs if base.embed_tokens is None else base.embed_tokens(inputs)
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        held = {int(index): layer for index, layer in base.layers._modules.items()}
        kinds = {index: layer_kind(config, index) for index in held}
        makers = {
            "full_attention": create_causal_mask,
            "sliding_attention": create_sliding_window_causal_mask,
        }
        masks = {
            kind: makers[kind](
                config=config,
                inputs_embeds=hidden,
                attention_mask=None,
                cache=None,
                position_ids=position_ids,
            )
            for kind in set(kinds.values())
        }
        tables = {kind: _rotary(base.rotary_emb, hidden, position_ids, kind) for kind in set(kinds.values())}
        for index, layer in held.items():
            hidden = layer(
                hidden,
                attention_mask=masks[kinds[index]],
                position_embeddings=tables[kinds[index]],
                position_ids=position_ids,
            )
        if self.hf.lm_head is None:
            return hidden
        logits = self.hf.lm_head(base.norm(hidden))
        cap = getattr(config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _balancing_loss(hf: nn.Module) -> Any:
    """transformers' load_balancing_loss_func of the model's family (Switch/Mixtral form), or None where it has none."""
    module = sys.modules.get(type(hf).__module__)
    return getattr(module, "load_balancing_loss_func", None) if hasattr(hf, "num_experts_per_tok") else None


def layer_kind(config: Any, index: int) -> str:
    """full_attention or sliding_attention: the mask layer `index` of a transformers decoder attends with."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return kinds[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def _rotary(rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, kind: str) -> Any:
    """The rotary tables for one layer kind (Gemma-3 keeps a local table for its sliding layers)."""
    if _takes_layer_type(type(rotary)):
        return rotary(hidden, position_ids, kind)
    return rotary(hidden, position_ids=position_ids)


@functools.cache
def _takes_layer_type(rotary_class: type) -> bool:
    """Whether a rotary embedding class's forward takes the layer kind (read once per class, not per step)."""
    return "layer_type" in inspect.signature(rotary_class.forward).parameters


PIPELINE_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
"""What a transformers model's base must hold (Llama and its relatives) for hf_stage to cut it."""


def pipeline_problem(hf: nn.Module) -> str | None:
    """Why a transformers model cannot be cut into pipeline stages (None: it can)."""
    family = family_attention(hf.config, type(hf))
    if family.pipeline_problem:
        return family.pipeline_problem
    base = getattr(hf, "model", None)
    missing = [name for name in PIPELINE_PARTS if base is None or not hasattr(base, name)]
    if missing or not hasattr(hf, "lm_head"):
        return (
            f"{type(hf).__name__} is not laid out like Llama (model.embed_tokens, model.layers, model.norm, "
            "model.rotary_emb, lm_head), which pipeline stages are cut from"
        )
    return None


def hf_stage(model: HFCausalLM, layers: range, *, first: bool, last: bool) -> HFCausalLM:
    """Keep `layers` of a Llama-style model (and its embedding if first, its norm and head if last)."""
    from launcher.components.model.stage_layers import StageLayers

    problem = pipeline_problem(model.hf)
    if problem:
        raise ValueError(problem + ".")
    base = model.hf.model
    base.layers = StageLayers({i: base.layers[i] for i in layers})
    if not first:
        base.embed_tokens = None
    if not last:
        base.norm = None
        model.hf.lm_head = None
    model.pipeline_stage = True
    return model


def _load(cfg: ModelConfig, config: Any, *, empty: bool) -> tuple[nn.Module, str]:
    """(transformers model, where its weights came from): the folder's weights, random, or meta (empty)."""
    from transformers import AutoModelForCausalLM

    if empty:
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):  # rotary tables and the like stay real
            hf = AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=torch.float32)
        hf.tie_weights()  # the empty build leaves a tied head as its own (meta) matrix
        return hf, f"weights from {cfg.path}, loaded after sharding"
    if cfg.path is not None:
        with refusing_folder(cfg.path):  # pytorch_model.bin weights-only, safetensors' header checked
            hf = AutoModelForCausalLM.from_pretrained(
                cfg.path, config=config, local_files_only=True, trust_remote_code=False, dtype=torch.float32
            )
        return hf, f"weights from {cfg.path}"
    hf = AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=torch.float32)
    return hf, f"random weights ({cfg.hf_config})"


def build_hf_model(cfg: ModelConfig, *, empty: bool = False, announce: bool = True) -> HFCausalLM:
    """The HF model `cfg` describes, float32 on the CPU (parameters on the meta device if `empty`).

    Random init depends only on torch's seed.
    """
    config = hf_config(cfg)
    hf, source = _load(cfg, config, empty=empty)
    hf.config.use_cache = False
    rows = hf.get_input_embeddings().num_embeddings
    if cfg.resize_embeddings and cfg.vocab_size is not None and cfg.vocab_size != rows:
        # new rows: drawn from the seeded generator, like init (an empty build has no values to draw from)
        hf.resize_token_embeddings(cfg.vocab_size, mean_resizing=not empty)
        source += f", token embedding resized {rows} -> {cfg.vocab_size} for the tokenizer"
    if announce and int(os.environ.get("RANK", "0")) == 0:
        Console().print(
            f"model: Hugging Face {type(hf).__name__} ({source}); use_cache=False: the "
            "key-value cache only serves generation, so training turns it off",
            soft_wrap=True,
        )
    return HFCausalLM(conv1d_to_linear(hf), attention=cfg.attention)


def hf_decoder_layers(model: HFCausalLM) -> nn.ModuleList | None:
    """A transformers model's repeated decoder layers (its class named in `_no_split_modules`); None if not found.

    The one ModuleList holding them is found by that class.
    """
    names = set(getattr(model.hf, "_no_split_modules", None) or ())
    for module in model.hf.modules():
        if isinstance(module, nn.ModuleList) and len(module) and type(next(iter(module))).__name__ in names:
            return module
    return None


def hf_checkpointing(model: HFCausalLM, every_n_layers: int = 1, options: dict | None = None) -> None:
    """Turn on the HF model's own activation checkpointing (non-reentrant).

    transformers 5 calls it `activation_checkpointing_enable` (`gradient_checkpointing_enable` is
    deprecated there); older releases have only the latter. `options` go to torch's checkpoint (a
    selective policy's context_fn). Inputs are made to require grad so a
    frozen embedding (LoRA) still lets gradients reach the adapters inside checkpointed layers.
    """
    hf = model.hf
    kwargs = {"use_reentrant": False, **(options or {})}
    if hasattr(hf, "activation_checkpointing_enable"):
        hf.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers
        )
    else:
        if every_n_layers != 1:
            raise ValueError("this transformers release checkpoints every layer only (every_n_layers=1).")
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    hf.enable_input_require_grads()
