"""LoRA adapters for any linear layer (plain or bitsandbytes): the `quantization.lora` schema and its layers.

A `LoRALinear` wraps a base layer and adds `scale * B(A(dropout(x)))`, with A initialized like a
linear layer and B at zero, so an adapted model starts exactly where its base model is. Folding
adapters back into plain weights is launcher.groups.quantization.merged_state_dict (it also
dequantizes the int8/nf4 base weights).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Low-rank adapters added to linear layers; with them only the adapters train."""

    rank: int = 0
    """Rank r of each adapter (B @ A with A: r x in, B: out x r); 0 adds no adapters."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input (training only)."""
    targets: list[str] | None = None
    """Module-name suffixes to adapt (e.g. [q_proj, v_proj]); null: every linear layer of the blocks."""


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the submodule `name` was."""
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name), leaf, new)


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
