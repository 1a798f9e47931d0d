"""The optimizer group: schema, parameter groups and the table of optimizer builders.

Besides torch's AdamW and SGD, the memory-lean options: 8-bit AdamW / Lion (bitsandbytes), paged
AdamW and torch's Adafactor; and Muon (launcher.components.muon) for the hidden matrices, with
AdamW for the rest. They receive the same parameter groups as AdamW (weight decay on matrices
only); each builder passes on the keys its row of launcher.config.optimizer.READS names.
bitsandbytes keeps the Adam moments (Lion's momentum) of every tensor with at
least 4096 elements in 8 bits, block-wise quantized; smaller tensors keep 32-bit state. A paged
optimizer needs CUDA unified memory: on a CPU it runs as plain 8-bit AdamW, with a warning.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from launcher.config.optimizer import FUSED_AUTO_DEVICES, OptimizerConfig

if TYPE_CHECKING:  # torch only where a rank builds the optimizer: the launching process never needs it
    import torch
    from torch import nn


OptimizerBuilder = Callable[[list[dict], OptimizerConfig, str], "torch.optim.Optimizer"]
"""Builds an optimizer from (parameter groups, config, device type)."""


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


def muon_param_groups(named_params: Iterable[tuple[str, nn.Parameter]], cfg: OptimizerConfig) -> list[dict]:
    """Muon's split: hidden 2-D matrices to Muon; muon_exclude's names, other matrices and 1-D tensors to AdamW."""
    muon, decay, no_decay = [], [], []
    for name, param in named_params:
        if not param.requires_grad:
            continue
        if param.ndim == 2 and not any(fnmatch.fnmatchcase(name, pattern) for pattern in cfg.muon_exclude):
            muon.append(param)
        else:
            (decay if cfg.decay_norms_and_biases or param.ndim >= 2 else no_decay).append(param)
    adamw_lr = cfg.lr if cfg.adamw_lr is None else cfg.adamw_lr
    groups = [
        {"params": muon, "use_muon": True, "weight_decay": cfg.weight_decay},
        {"params": decay, "use_muon": False, "weight_decay": cfg.weight_decay, "lr": adamw_lr},
        {"params": no_decay, "use_muon": False, "weight_decay": 0.0, "lr": adamw_lr},
    ]
    return [group for group in groups if group["params"]]


def _fused_on(name: str, device_type: str) -> bool:
    """Whether `auto` means fused for optimizer `name` on `device_type` with the installed torch."""
    if device_type not in FUSED_AUTO_DEVICES.get(name, ()):
        return False
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return device_type in _get_fused_kernels_supported_devices()


def _kernel_flags(cfg: OptimizerConfig, device_type: str) -> dict:
    """Map `implementation` to torch's fused/foreach keyword arguments (foreach unset when fused: torch
    refuses both)."""
    choice = cfg.implementation
    if choice == "auto":
        choice = "fused" if _fused_on(cfg.name, device_type) else "foreach"
    return {"fused": choice == "fused", "foreach": True if choice == "foreach" else None}


def _adamw(groups: list[dict], cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    import torch

    flags = _kernel_flags(cfg, device_type)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **flags)


def _sgd(groups: list[dict], cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    import torch

    flags = _kernel_flags(cfg, device_type)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **flags)


def _bnb_optim():
    """bitsandbytes.optim, imported on use so bitsandbytes stays an optional extra."""
    import bitsandbytes as bnb

    return bnb.optim


def _adamw_8bit(groups: list[dict], cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    return _bnb_optim().AdamW8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def _paged_adamw_8bit(groups: list[dict], cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    if device_type != "cuda":
        warnings.warn(
            f"optimizer=paged_adamw_8bit: paging needs CUDA unified memory and this run is on {device_type}, "
            "so it runs as adamw_8bit (the same update, unpaged state).",
            stacklevel=2,
        )
        return _adamw_8bit(groups, cfg, device_type)
    return _bnb_optim().PagedAdamW8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def _lion_8bit(groups: list[dict], cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    return _bnb_optim().Lion8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas))


def _adafactor(groups: list[dict], cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    import torch

    foreach = {"auto": None, "foreach": True, "for_loop": False}[cfg.implementation]
    return torch.optim.Adafactor(
        groups,
        lr=cfg.lr,
        beta2_decay=cfg.beta2_decay,
        eps=(cfg.eps, cfg.eps2),
        d=cfg.clip_threshold,
        foreach=foreach,
    )


def _muon(groups: list[dict], cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    from launcher.components.muon import MuonWithAdamW

    flags = _kernel_flags(dataclasses.replace(cfg, name="adamw"), device_type)
    adamw = {"betas": tuple(cfg.betas), "eps": cfg.eps, **flags}
    return MuonWithAdamW(
        groups,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        ns_steps=cfg.ns_steps,
        adjust_lr_fn=cfg.adjust_lr_fn,
        adamw=adamw,
    )


def _adamw_schedule_free(groups: list[dict], cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    """schedulefree's AdamW; its warmup is the scheduler group's (constant), so its own stays 0."""
    import schedulefree

    foreach = cfg.implementation != "for_loop"
    return schedulefree.AdamWScheduleFree(
        groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, warmup_steps=0, foreach=foreach
    )


OPTIMIZERS: dict[str, OptimizerBuilder] = {
    "adamw": _adamw,
    "sgd": _sgd,
    "adamw_8bit": _adamw_8bit,
    "paged_adamw_8bit": _paged_adamw_8bit,
    "lion_8bit": _lion_8bit,
    "adafactor": _adafactor,
    "muon": _muon,
    "adamw_schedule_free": _adamw_schedule_free,
}
"""Every option of the optimizer group and its builder."""

PARAM_SPLITS: dict[str, Callable[[Iterable[tuple[str, nn.Parameter]], OptimizerConfig], list[dict]]] = {
    "muon": muon_param_groups,
}
"""The options that split the parameters their own way (the others take param_groups)."""


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    """Build the configured optimizer over `model`'s trainable parameters."""
    split = PARAM_SPLITS.get(cfg.name, param_groups)
    return OPTIMIZERS[cfg.name](split(model.named_parameters(), cfg), cfg, device_type)
