"""Build the model the model group describes, and count its size and training cost."""

from __future__ import annotations

from torch import nn

from launcher.components.model.family import family
from launcher.components.model.shape import model_shape
from launcher.config.model import ModelConfig


def build_model(cfg: ModelConfig, *, empty: bool = False) -> nn.Module:
    """The model the config describes (its family builds it), on the CPU in float32; init depends only on torch's seed.

    `empty` (a family's pretrained folder only): parameters on the meta device, for a strategy that shards
    the model and then loads the weights into the shards (launcher.parallel.pretrained).
    """
    return family(cfg).build(cfg, empty=empty)


def num_params(model: nn.Module) -> int:
    """Parameters of `model`, a tied matrix counted once."""
    return sum(p.numel() for p in model.parameters())


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, 6 * N + 12 * n_layer * d_model * seq_len (forward + backward).

    N counts the parameters a token runs through (an MoE block's top_k experts, so MFU uses the active
    ones) without building real weights (launcher.components.model.shape: the GPT's config formula, a
    Hugging Face model's meta-device build), a tied embedding counted once; the second term is the
    attention score and value products.
    """
    shape = model_shape(cfg)
    active = shape.num_active_params if shape.num_active_params is not None else shape.num_params
    return float(6 * active + 12 * shape.equivalent.n_layer * shape.equivalent.d_model * seq_len)
