"""Expert parallelism (parallel.ep_size > 1) of a model's experts sites under DDP and FSDP2.

An experts site (`expert_sites`) is a module holding stacked routed experts: the built-in GPT's MoE blocks
and transformers 5's experts modules. The data-parallel (x context-parallel) ranks that share a pipeline and
tensor-parallel coordinate form groups of ep_size consecutive ones (`expert_mesh`); each rank of a group
holds E / ep_size consecutive experts of every site (`apply`: its slice of the stacked weights, cut from
the same seeded init every rank built, so the experts are those of a one-process run) and the tokens
travel to them by all-to-all (launcher.components.model.experts). The ranks holding the same experts (one
per group, at the same position) are the experts' replicas.

`ExpertShards` is what the strategy asks of them:

- under DDP the expert weights are left out of DDP's buckets (they differ between the ranks of a group);
  after the step's backward their gradients are summed over the replicas and divided by the data (x
  context) ranks, as DDP averages the rest (a rank's expert gradient already holds every group rank's
  tokens, brought back by the all-to-all), and the clipping norm adds the squared norms of the group's
  expert gradients to the rest's;
- under FSDP2 (`fully_shard_experts`, torchtitan's layout) each site is its own FSDP2 group over the
  replicas: each rank stores 1 / (data x context ranks) of every expert tensor, gathered over the replicas
  for the forward, and the gradients are reduce-scattered over them with the same divisor; the experts'
  DTensors span the whole (replica, ep) mesh, so the clipping norm counts every expert once;
- checkpoints hold whole experts: under DDP gathered over the group for model.pt and the optimizer's
  moments and cut to this rank's slice on load; under FSDP2 the shards are DTensors of the whole
  experts, which DCP saves and reshards. A checkpoint of any ep_size resumes at any other, or in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from launcher.components.model.experts import ExpertGroup
from launcher.components.model.hf_experts import FUSED
from launcher.components.model.moe_balance import moe_blocks
from launcher.parallel.pipeline_stage import local_tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

EXPERT_WEIGHTS = ("w_up", "w_down")
"""The stacked expert weights of an MoE block (launcher.components.model.moe.MoE), split along dim 0."""

Sites = dict[str, tuple[nn.Module, tuple[str, ...]]]
"""Qualified module name -> (the module holding stacked experts, names of its expert parameters)."""


def expert_sites(model: nn.Module) -> Sites:
    """Every module of `model` holding stacked routed experts, and the names of those parameters (split along dim 0).

    The built-in GPT's MoE blocks (w_up, w_down) and transformers 5's experts modules (`mlp.experts`: the fused
    gate_up_proj and down_proj, and their biases where the family has them, as gpt-oss does).
    """
    names = {id(module): name for name, module in model.named_modules()}
    sites: Sites = {names[id(block)]: (block, EXPERT_WEIGHTS) for block in moe_blocks(model).values()}
    for name, module in model.named_modules():
        fused = tuple(n for n in FUSED if isinstance(module._parameters.get(n), nn.Parameter))
        if name.endswith("experts") and {"gate_up_proj", "down_proj"} <= set(fused):
            sites[name] = (module, fused)
    return sites


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The squared norm of `grads` in fp32 (of the whole tensors where they are DTensor shards); 0 for none."""
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, foreach=any(isinstance(g, DTensor) for g in grads))
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).to(torch.float32) ** 2


@dataclass(kw_only=True)
class ExpertShards:
    """This rank's expert slices: their names, the group that splits them and the replicas that share them."""

    params: dict[str, nn.Parameter]
    """Parameter name in the unwrapped model -> this rank's slice of that expert weight."""
    group: ExpertGroup
    """The expert-parallel group of this rank."""
    replicas: dist.ProcessGroup | None
    """The ranks holding the same experts (None: just this one)."""
    world_size: int
    """Data (x context) parallel ranks of the job: DDP's and FSDP2's averaging divisor."""
    sites: Sites = field(default_factory=dict)
    """The experts sites `apply` split (qualified module name -> (module, expert parameter names))."""
    mesh: DeviceMesh | None = None
    """The (replica, ep) mesh of the experts (`expert_mesh`)."""
    sharded: bool = False
    """FSDP2 shards the slices over the replicas and reduces their gradients (`fully_shard_experts`)."""
    ids: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.ids = {id(p) for p in self.params.values()}

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum the expert gradients over the replicas and divide by the world size (DDP's mean of the rest);
        nothing where FSDP2 has reduce-scattered them already."""
        if self.sharded:
            return
        for param in self.params.values():
            if param.grad is None:
                continue
            grad = local_tensor(param.grad)
            if self.replicas is not None:
                dist.all_reduce(grad, group=self.replicas)
            grad.div_(self.world_size)

    def clip(self, params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
        """Clip by the global norm (the rest's gradients and every expert's once); returns it.

        Under DDP a rank's expert slices are its group's share: their squared norm is summed over the group.
        Under FSDP2 each expert row is held by one rank of the world: the DTensor norm covers them all.
        """
        dense = _squared_norm([p.grad for p in params if id(p) not in self.ids])
        if self.sharded:
            experts = _squared_norm([p.grad for p in params if id(p) in self.ids])
        else:
            experts = _squared_norm([local_tensor(p.grad) for p in params if id(p) in self.ids])
            dist.all_reduce(experts, group=self.group.group)
        total = (dense + experts).sqrt()
        if max_norm is not None:
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for p in params:
                local_tensor(p.grad).mul_(coef.to(p.grad.dtype))
        return total

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor of a slice along dim 0, gathered over the group (collective)."""
        pieces = [torch.empty_like(local) for _ in range(self.group.size)]
        dist.all_gather(pieces, local.contiguous(), group=self.group.group)
        return torch.cat(pieces)

    def _slice(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole expert tensor."""
        local = whole.shape[0] // self.group.size
        return whole[self.group.rank * local : (self.group.rank + 1) * local].clone()

    def full_model(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A model state dict with whole experts (collective: every rank of the group calls it)."""
        return {k: self._gather(v) if k in self.params else v for k, v in state.items()}

    def local_model(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole-expert model state dict cut to this rank's slices."""
        return {k: self._slice(v) if k in self.params else v for k, v in state.items()}

    def _expert_indices(self, optimizer: torch.optim.Optimizer) -> dict[int, nn.Parameter]:
        """The optimizer state_dict's index of each expert slice (params numbered in param-group order)."""
        order = [p for group in optimizer.param_groups for p in group["params"]]
        return {i: p for i, p in enumerate(order) if id(p) in self.ids}

    def _map_optimizer(
        self, state: dict[str, Any], optimizer: torch.optim.Optimizer, fn: Any
    ) -> dict[str, Any]:
        """`state` (an optimizer state_dict) with `fn` applied to each expert's per-row state (its moments)."""
        experts = self._expert_indices(optimizer)
        mapped = dict(state["state"])
        for index in sorted(experts):
            entry = mapped.get(index)
            if entry is not None:
                rows = {k: fn(v) for k, v in entry.items() if torch.is_tensor(v) and v.dim() == 3}
                mapped[index] = {**entry, **rows}
        return {**state, "state": mapped}

    def full_optimizer(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state_dict with whole-expert moments (collective over the group)."""
        return self._map_optimizer(optimizer.state_dict(), optimizer, self._gather)

    def local_optimizer(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """A whole-expert optimizer state_dict cut to this rank's slices."""
        return self._map_optimizer(state, optimizer, self._slice)


def expert_mesh(world: DeviceMesh, ep_size: int) -> DeviceMesh:
    """The (replica, ep) mesh of this rank's experts, cut from the world mesh's data-parallel (x context) axis.

    The ranks that split the experts share this rank's pipeline and tensor-parallel coordinates (each tp rank
    of a group holds the same experts and tokens): the dp_shard (x cp) axis is unflattened into "replica"
    (the ranks holding the same experts) and "ep" (ep_size consecutive data ranks).
    """
    shard = "dp_shard"
    if world["cp"].size() > 1:  # FSDP2's shard axis under context parallel (launcher.parallel.fsdp.data_mesh)
        shard = "dp_shard_cp"
        try:
            world[shard]
        except KeyError:  # flattened once per mesh
            world["dp_shard", "cp"]._flatten(shard)
    data = world[shard]
    return data._unflatten(0, (data.size() // ep_size, ep_size), ("replica", "ep"))


def apply(model: nn.Module, world: DeviceMesh, ep_size: int, *, dtensors: bool) -> ExpertShards:
    """Keep this rank's slice of every experts site (`expert_sites`), route through the group; the shards' record.

    Each site gets `expert_group` (its forward dispatches the tokens when it is set) and its expert parameters
    replaced by this rank's slices along dim 0; its forward is left as it is. The groups are the axes of
    `expert_mesh` (cut from the world mesh `world`): "ep" the ranks that split the experts, "replica" the ranks
    holding the same ones. `dtensors` (FSDP2): each slice is a DTensor of the whole expert tensor over the
    "ep" axis (sharded along the experts), which `fully_shard_experts` then shards over the "replica" axis, so
    DCP saves whole experts and reshards them to any ep_size. Gradients average over the mesh's ranks (the
    data and context ranks): tensor-parallel peers compute the same expert gradients from the same tokens.
    """
    from torch.distributed.tensor import Shard

    mesh = expert_mesh(world, ep_size)
    group = ExpertGroup(group=mesh["ep"].get_group(), rank=mesh["ep"].get_local_rank(), size=ep_size)
    replicas = mesh["replica"].get_group() if mesh.size() > ep_size else None
    params: dict[str, nn.Parameter] = {}
    sites = expert_sites(model)
    for site, (module, names) in sites.items():
        module.expert_group = group
        for name in names:
            whole = getattr(module, name)
            local = whole.shape[0] // ep_size
            piece = whole.detach()[group.rank * local : (group.rank + 1) * local].clone()
            if dtensors:
                piece = DTensor.from_local(piece, mesh["ep"], [Shard(0)], run_check=False)
            param = nn.Parameter(piece, requires_grad=whole.requires_grad)
            setattr(module, name, param)
            params[f"{site}.{name}"] = param
    return ExpertShards(
        params=params, group=group, replicas=replicas, world_size=mesh.size(), sites=sites, mesh=mesh
    )


def fully_shard_experts(shards: ExpertShards, **kwargs: Any) -> None:
    """FSDP2 over each experts site: its expert slices sharded over their replicas, the rest over `kwargs`' mesh.

    torchtitan's layout: the experts' own FSDP2 group spans the ranks holding the same experts (the data-parallel
    ranks modulo ep), so each rank stores 1 / (data x context ranks) of every expert tensor, and their
    gradients are reduce-scattered over the replicas and divided by the data (x context) ranks (the all-to-all
    already brought every group rank's tokens' gradients; the rest is averaged over the same ranks). The site's other
    submodules holding parameters (the GPT block's router and shared MLP) are sharded first, over the data
    mesh, as their block's would be. Call before the enclosing layers' `fully_shard` (bottom-up).
    """
    from torch.distributed.fsdp import fully_shard

    assert shards.mesh is not None, "fully_shard_experts needs the experts' mesh that apply() built"
    for site, (module, names) in shards.sites.items():
        other = [n for n, _ in module.named_parameters(recurse=False) if n not in names]
        if other:
            raise ValueError(f"{site}: parameters {other} beside the experts cannot be sharded with them.")
        for child in module.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, **kwargs)
        experts = fully_shard(module, **{**kwargs, "mesh": shards.mesh["replica"]})
        experts.set_gradient_divide_factor(float(shards.world_size))
        # over replicas: sum, then divide (gloo has no pre-multiplied sum); over one rank (ep_size = data ranks)
        # torch 2.13 divides by a forced sum's factor twice, where its plain path divides once
        experts.set_force_sum_reduction_for_comms(shards.replicas is not None)
        for name in names:  # fully_shard replaced the parameters by their shards
            shards.params[f"{site}.{name}"] = module._parameters[name]
    shards.ids = {id(p) for p in shards.params.values()}
    shards.sharded = True
