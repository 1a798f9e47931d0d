"""The optimizer group: schema, parameter groups and a registry of optimizer builders."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Which optimizer updates the weights, and its hyper-parameters."""

    name: str = "adamw"
    """Registered optimizer name (see OPTIMIZERS)."""
    lr: float = 1e-3
    """Peak learning rate (the scheduler scales it per step)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only unless decay_norms_and_biases."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam-family moment coefficients."""
    eps: float = 1e-8
    """Adam-family denominator epsilon."""
    momentum: float = 0.9
    """SGD momentum."""
    nesterov: bool = False
    """SGD Nesterov momentum."""
    decay_norms_and_biases: bool = False
    """Apply weight decay to norm weights and biases as well (usually worse)."""
    implementation: str = "auto"
    """torch kernel choice: auto (fused on CUDA, foreach otherwise), fused, foreach or for_loop."""


OptimizerBuilder = Callable[[list[dict], OptimizerConfig, str], torch.optim.Optimizer]
OPTIMIZERS: dict[str, OptimizerBuilder] = {}


def register_optimizer(name: str) -> Callable[[OptimizerBuilder], OptimizerBuilder]:
    """Add an optimizer builder under `name`; the builder gets param groups, config and device type."""

    def wrap(builder: OptimizerBuilder) -> OptimizerBuilder:
        OPTIMIZERS[name] = builder
        return builder

    return wrap


def param_groups(named_params: Iterable[tuple[str, nn.Parameter]], cfg: OptimizerConfig) -> list[dict]:
    """Split trainable parameters into decayed (matrices) and undecayed (norms, biases, 1-D) groups."""
    decay, no_decay = [], []
    for _, param in named_params:
        if not param.requires_grad:
            continue
        (decay if cfg.decay_norms_and_biases or param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _kernel_flags(cfg: OptimizerConfig, device_type: str) -> dict:
    """Map `implementation` to torch's fused/foreach keyword arguments."""
    choice = cfg.implementation
    if choice == "auto":
        choice = "fused" if device_type == "cuda" else "foreach"
    return {"fused": choice == "fused", "foreach": choice == "foreach" or None}


@register_optimizer("adamw")
def _adamw(groups: list[dict], cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    flags = _kernel_flags(cfg, device_type)
    if flags["fused"]:
        flags["foreach"] = None
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **flags)


@register_optimizer("sgd")
def _sgd(groups: list[dict], cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    flags = _kernel_flags(cfg, device_type)
    if flags["fused"]:
        flags["foreach"] = None
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **flags)


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    """Build the configured optimizer over `model`'s trainable parameters."""
    return OPTIMIZERS[cfg.name](param_groups(model.named_parameters(), cfg), cfg, device_type)


# Builders of the memory-lean optimizers register themselves on import (bitsandbytes loads lazily).
from launcher.groups import optimizer_8bit as optimizers_extra  # noqa: E402, F401
