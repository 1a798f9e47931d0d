"""Memory-lean optimizers: 8-bit AdamW / Lion (bitsandbytes), paged AdamW and torch's Adafactor.

They register under the optimizer group's registry and receive the same parameter groups as
AdamW (weight decay on matrices only). bitsandbytes keeps the Adam moments (Lion's momentum) of
every tensor with at least 4096 elements in 8 bits, block-wise quantized; smaller tensors keep
32-bit state. A paged optimizer needs CUDA unified memory: on a CPU it runs as plain 8-bit AdamW,
with a warning.
"""

from __future__ import annotations

import warnings

import torch

from launcher.groups.optimizer import OptimizerConfig, register_optimizer

BNB_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit", "lion_8bit")


def _bnb_optim():
    """bitsandbytes.optim, imported on use so bitsandbytes stays an optional extra."""
    import bitsandbytes as bnb

    return bnb.optim


@register_optimizer("adamw_8bit")
def _adamw_8bit(groups: list[dict], cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    return _bnb_optim().AdamW8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


@register_optimizer("paged_adamw_8bit")
def _paged_adamw_8bit(groups: list[dict], cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    if device_type != "cuda":
        warnings.warn(
            f"optimizer=paged_adamw_8bit: paging needs CUDA unified memory and this run is on {device_type}, "
            "so it runs as adamw_8bit (the same update, unpaged state).",
            stacklevel=2,
        )
        return _adamw_8bit(groups, cfg, device_type)
    return _bnb_optim().PagedAdamW8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


@register_optimizer("lion_8bit")
def _lion_8bit(groups: list[dict], cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    return _bnb_optim().Lion8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas))


@register_optimizer("adafactor")
def _adafactor(groups: list[dict], cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    foreach = {"auto": None, "foreach": True, "for_loop": False}[cfg.implementation]
    return torch.optim.Adafactor(groups, lr=cfg.lr, foreach=foreach)
