"""LoRA adapters for any linear layer (plain or bitsandbytes), and merging them into plain weights.

A `LoRALinear` wraps a base layer and adds `scale * B(A(dropout(x)))`, with A initialized like a
linear layer and B at zero, so an adapted model starts exactly where its base model is. Merging
folds `scale * B @ A` into the base weight, dequantizing int8/nf4 weights to float32 first, and
returns a state dict with the key names and dtypes of the model `launcher.groups.model.gpt.build_model` builds.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

from launcher.groups.quantization import LoRAConfig, is_quantized, replace_module


class LoRALinear(nn.Module):
    """A frozen base linear layer plus a trainable low-rank update B @ A scaled by alpha / rank."""

    def __init__(self, base: nn.Module, *, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's own init
        device = base.weight.device
        if device.type != "meta":  # adapters live beside their base layer; init stays on the CPU RNG
            self.lora_A.data, self.lora_B.data = self.lora_A.data.to(device), self.lora_B.data.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """base(x) + scale * B(A(dropout(x)))."""
        update = F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)
        return self.base(x) + update * self.scale

    def delta_weight(self) -> torch.Tensor:
        """The update this adapter adds to the base weight, scale * B @ A, in float32."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scale


def matches(name: str, targets: list[str] | None) -> bool:
    """Whether the module `name` is targeted: its name ends with one of `targets` (null: all)."""
    if targets is None:
        return True
    return any(name == t or name.endswith("." + t) for t in targets)


def add_adapters(model: nn.Module, cfg: LoRAConfig, candidates: list[str]) -> nn.Module:
    """Wrap the targeted layers among `candidates` in LoRALinear and freeze every other parameter."""
    chosen = [name for name in candidates if matches(name, cfg.targets)]
    if not chosen:
        raise ValueError(
            f"quantization.lora.targets={cfg.targets} matches none of the model's linear layers "
            f"({', '.join(sorted({n.rsplit('.', 1)[-1] for n in candidates}))})."
        )
    for param in model.parameters():
        param.requires_grad_(False)
    for name in chosen:
        base = model.get_submodule(name)
        replace_module(model, name, LoRALinear(base, rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    if int(os.environ.get("RANK", "0")) == 0:
        Console().print(
            f"LoRA: rank {cfg.rank} on {len(chosen)} layers; {trainable:,} trainable of {total:,} "
            f"stored parameters ({100 * trainable / total:.2f}%), everything else frozen",
            soft_wrap=True,
        )
    return model


def dequantized_weight(layer: nn.Module) -> torch.Tensor:
    """The float32 weight a plain or bitsandbytes linear layer represents."""
    if not is_quantized(layer):
        return layer.weight.detach().float()
    import bitsandbytes.functional as bnbf

    weight = layer.weight
    if hasattr(weight, "quant_state"):  # nf4
        return bnbf.dequantize_4bit(weight.data, weight.quant_state).float()
    codes = weight.CB if weight.CB is not None else layer.state.CB
    scales = weight.SCB if weight.SCB is not None else layer.state.SCB
    return bnbf.int8_vectorwise_dequant(codes, scales).float()


def _plain_linear_state(layer: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """weight (merged, dequantized) and bias of `layer` under `prefix`, as a plain nn.Linear has them."""
    base = layer.base if isinstance(layer, LoRALinear) else layer
    weight = dequantized_weight(base)
    if isinstance(layer, LoRALinear):
        weight = weight + layer.delta_weight().to(weight.device)
    state = {f"{prefix}weight": weight.cpu()}
    if base.bias is not None:
        state[f"{prefix}bias"] = base.bias.detach().float().cpu()
    return state


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A plain float32 state dict of `model` with adapters folded in and quantized weights dequantized.

    It loads into the same architecture built without quantization or adapters.
    """
    special = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, LoRALinear) or (is_quantized(module) and not name.endswith(".base"))
    }
    prefixes = tuple(f"{name}." for name in special)
    state = {
        key: value.detach().float().cpu() if value.is_floating_point() else value.detach().cpu()
        for key, value in model.state_dict().items()
        if not key.startswith(prefixes)
    }
    for name, module in special.items():
        state.update(_plain_linear_state(module, f"{name}."))
    return state


def has_adapters_or_quantization(model: nn.Module) -> bool:
    """Whether `model` holds LoRA adapters or quantized layers (then export must merge)."""
    return any(isinstance(m, LoRALinear) or is_quantized(m) for m in model.modules())
