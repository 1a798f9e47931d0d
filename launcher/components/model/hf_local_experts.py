"""Routed experts kept whole on every tensor-parallel rank: replicated DTensor parameters, local computation.

Tensor parallelism splits a Mixture-of-Experts model's dense parts (attention, shared experts) by the
family's plan; the routed experts stay whole (expert parallelism, not TP, is what splits them). Their
parameters become replicated DTensors like every other unsplit parameter (one optimizer, clip and checkpoint
path for all), but transformers computes them with kernels DTensor has no sharding rule for (grouped GEMMs,
index_add over routed tokens), so `LocalExperts` runs the experts' and their router's forward on the local
copies (the router hands the experts plain top-k indices and weights): each rank
holds the same input (the attention's output, all-reduced) and computes the same result, and each copy's
gradient reaches its replicated parameter unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class LocalExperts(ParallelStyle):
    """Parameters replicated DTensors; the forward reads their local tensors (plain inputs, plain outputs)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names = []
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                replicated = distribute_tensor(param.data, device_mesh, [Replicate()])
                module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
            names.append(name)
        module.register_forward_pre_hook(lambda m, args: _shadow(m, names))
        module.register_forward_hook(lambda m, args, out: _unshadow(m, names, out))
        return module


def _shadow(module: nn.Module, names: list[str]) -> None:
    """Attribute lookups of the parameters find their local tensors (instance attributes win over _parameters)."""
    for name in names:
        module.__dict__[name] = module._parameters[name].to_local()


def _unshadow(module: nn.Module, names: list[str], output: Any) -> Any:
    """The parameters visible again after the forward."""
    for name in names:
        module.__dict__.pop(name, None)
    return output


ROUTERS = ("gate", "router")
"""Names of the router beside the experts in transformers' MoE blocks (its top-k outputs feed the experts)."""


def local_expert_modules(model: nn.Module) -> list[str]:
    """Names of the modules holding routed experts' fused parameters and of their routers (kept whole, run locally)."""
    from launcher.components.model.hf_experts import is_expert_parameter

    experts = {name.rsplit(".", 1)[0] for name, _ in model.named_parameters() if is_expert_parameter(name)}
    routers = {
        f"{block}.{router}"
        for block in {name.rsplit(".", 1)[0] for name in experts}
        for router in ROUTERS
        if isinstance(getattr(model.get_submodule(block), router, None), nn.Module)
    }
    return sorted(experts | routers)
