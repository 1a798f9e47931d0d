"""The attention paths of a Hugging Face model: transformers' implementation name for each, and varlen.

`hf_implementation` turns `model.attention` into the attn_implementation transformers runs for this
family (launcher.components.model.hf_family says which paths reproduce which family); varlen runs
through `hf_varlen_attention`, registered with transformers' AttentionInterface.
"""

from __future__ import annotations

from typing import Any

import torch

from launcher.components.model.attention import span_sizes, varlen_attention
from launcher.components.model.hf_family import FamilyAttention
from launcher.components.model.long_context import resolve_attention

HF_VARLEN = "launcher_varlen"
"""The name under which transformers' AttentionInterface knows `hf_varlen_attention`."""
HONOURED = {"position_ids", "sliding_window", "softcap", "is_causal"}
"""Keyword arguments of transformers' attention call the varlen path reads (the rest carry no maths)."""
ALTERING = ("s_aux",)
"""Keyword arguments that change the attention's maths and that the varlen path does not compute."""


def hf_varlen_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    dropout: float = 0.0, scaling: float | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers attention function: causal attention per packed document of head-major [B, H, T, D] inputs.

    The documents come from the layer's position_ids; transformers builds no mask for a custom
    implementation, so `attention_mask` is None here. A sliding-window layer passes its window and
    Gemma-2 its softcap; both are honoured. Returns [B, T, H, D], as transformers expects.
    """
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError(
            f"model.attention=varlen: {type(module).__name__} does not pass position_ids to its attention, "
            "so packed documents cannot be found; use model.attention=sdpa for this model family."
        )
    altering = [name for name in ALTERING if kwargs.get(name) is not None]
    if altering:
        raise ValueError(
            f"model.attention=varlen: {type(module).__name__} attends with {', '.join(altering)}, which the "
            "per-document path does not compute; use model.attention=sdpa for this model family."
        )
    sizes = span_sizes(position_ids.expand(query.shape[0], -1))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = varlen_attention(
        q, k, v, sizes, dropout_p=dropout if module.training else 0.0, scale=scaling,
        window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"),
    )  # fmt: skip
    return out, None


def hf_path(
    choice: str, family: FamilyAttention, *, packed: bool, device_type: str, seq_len: int | None = None
) -> str:
    """sdpa (the dense path), varlen or flex: what `model.attention=choice` runs for this family.

    `auto` steps around what a family lacks: flex without FlexAttention goes varlen, varlen that
    would not reproduce the family goes to the dense path (transformers' own masks). A chosen path
    the family lacks raises ValueError; the rules refuse it before launch.
    """
    path = resolve_attention(choice, packed=packed, device_type=device_type, seq_len=seq_len)
    if choice == "auto":
        if path == "flex" and not family.flex:
            path = "varlen"
        if path == "varlen" and family.varlen_problem:
            path = "sdpa"
        return path
    if path == "flex" and not family.flex:
        raise ValueError(f"model.attention=flex: transformers has no FlexAttention for {family.model_type}.")
    if path == "varlen" and family.varlen_problem:
        raise ValueError(f"model.attention=varlen: {family.varlen_problem}.")
    return path


def hf_implementation(
    choice: str, family: FamilyAttention, *, packed: bool, device_type: str, seq_len: int | None = None
) -> str:
    """transformers' attn_implementation for `model.attention=choice` (registering the varlen function)."""
    path = hf_path(choice, family, packed=packed, device_type=device_type, seq_len=seq_len)
    if path == "varlen":
        from transformers import AttentionInterface

        AttentionInterface.register(HF_VARLEN, hf_varlen_attention)
        return HF_VARLEN
    return {"sdpa": family.dense, "flex": "flex_attention", "flash_attention_2": "flash_attention_2"}[path]
