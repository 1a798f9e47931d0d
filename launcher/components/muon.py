"""Muon for the hidden matrices and AdamW for the rest, as one torch optimizer.

The Muon update is torch.optim.Muon's (momentum, optional Nesterov, Newton-Schulz orthogonalization
with torch's own `_zeropower_via_newtonschulz` and `_adjust_lr`, decoupled weight decay). The
Newton-Schulz step needs the whole matrix: a sharded parameter (a DTensor under FSDP2 or tensor
parallel) has its momentum gathered with full_tensor(), orthogonalized identically on every rank, and
each rank keeps its own shard, so 2 ranks compute what one process computes. The other parameters
(embeddings, the output head, norms, biases) are updated by torch's AdamW, which shares this
optimizer's parameter groups and state: one state_dict, which the checkpoint code (files, DCP,
get_optimizer_state_dict) saves, loads and reshards as it does AdamW's.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr, _zeropower_via_newtonschulz

NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
"""torch's (Keller Jordan's) quintic Newton-Schulz coefficients."""


def orthogonalized(update: torch.Tensor, ns_steps: int) -> torch.Tensor:
    """Newton-Schulz orthogonalization of a whole matrix; a DTensor is gathered, and each rank keeps its shard."""
    if not isinstance(update, DTensor):
        return _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, ns_steps, EPS).to(update.dtype)
    whole = _zeropower_via_newtonschulz(update.full_tensor(), NS_COEFFICIENTS, ns_steps, EPS).to(update.dtype)
    # Every rank holds the same whole result: src_data_rank=None slices the local shard without communication.
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer: groups with `use_muon` take torch's Muon update, the others torch's AdamW."""

    def __init__(
        self,
        groups: list[dict],
        *,
        lr: float,
        weight_decay: float,
        momentum: float,
        nesterov: bool,
        ns_steps: int,
        adjust_lr_fn: str,
        adamw: dict,
    ) -> None:
        adamw_groups = [g for g in groups if not g.get("use_muon", False)]
        # torch's AdamW fills its defaults into these very dicts; it steps them and shares our state.
        self._adamw = torch.optim.AdamW(adamw_groups or [{"params": []}], lr=lr, **adamw)
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "use_muon": False,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(groups, defaults)
        for group in self.param_groups:
            if group["use_muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError(
                    "Muon updates 2-D matrices only; other parameters belong to the AdamW groups"
                )
        self._link()

    def _link(self) -> None:
        """Point the inner AdamW at this optimizer's AdamW groups and state (again after a load replaced them)."""
        self._adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
        self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load (it replaces the group dicts and the state), then relink the inner AdamW."""
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch's signature)
        """One step: AdamW on its groups, then Muon on each matrix of the Muon groups."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adamw.param_groups:
            self._adamw.step()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
        return loss

    def _muon_group(self, group: dict) -> None:
        """torch.optim.Muon's single-tensor update, with the orthogonalization on whole matrices."""
        lr, momentum = group["lr"], group["momentum"]
        for param in group["params"]:
            if param.grad is None:
                continue
            grad, state = param.grad, self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            update = orthogonalized(update, group["ns_steps"])
            param.mul_(1 - lr * group["weight_decay"])
            param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
