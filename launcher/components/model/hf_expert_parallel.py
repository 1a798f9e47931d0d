"""Expert parallelism of transformers 5's experts modules: their forward routed through the expert-parallel group.

transformers' MoE blocks (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, gpt-oss) call their experts module as
`experts(hidden_states [N, D], top_k_index [N, k], top_k_weights [N, k])`, and each family's experts share
one computation, described by the attributes transformers' `use_experts_implementation` sets: per expert,
`gate_up = x @ gate_up_proj[e]` (stored [2F, D], or [D, 2F] where `is_transposed`, as gpt-oss stores it)
plus `gate_up_proj_bias[e]` where `has_bias`; the family's own `_apply_gate` (SiLU(gate) * up on the two
halves, or gpt-oss's interleaved, clamped `(up + 1) * gate * sigmoid(alpha * gate)`); then `down_proj[e]`
(and its bias), weighted by the token's routing weight and summed per token.

Once launcher.parallel.expert_parallel has set `expert_group` on such a module (its parameters this rank's
slices of the experts, along dim 0), `dispatch` makes its forward sort the token copies by expert and send
them to the ranks holding their experts (launcher.components.model.experts.dispatch_compute_combine), as
the built-in GPT's MoE blocks do; without a group it is transformers' own forward.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from launcher.components.model.experts import ExpertGroup, ExpertsFn, dispatch_compute_combine


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's tensor of a parameter (its local slice where it is a DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_hf_experts(module: nn.Module) -> bool:
    """Whether `module` is a transformers experts module whose computation `experts_fn` reproduces."""
    return (
        isinstance(module._parameters.get("gate_up_proj"), nn.Parameter)
        and isinstance(module._parameters.get("down_proj"), nn.Parameter)
        and callable(getattr(module, "_apply_gate", None))
        and getattr(module, "has_gate", False)
        and not getattr(module, "has_post_expert_norm", False)
    )


def experts_fn(module: nn.Module) -> ExpertsFn:
    """The family's expert MLP over rows sorted by this rank's experts (the module's local parameters)."""
    gate_up, down = _local(module.gate_up_proj), _local(module.down_proj)
    biases = getattr(module, "has_bias", False)
    gate_up_bias = _local(module.gate_up_proj_bias) if biases else None
    down_bias = _local(module.down_proj_bias) if biases else None
    transposed = getattr(module, "is_transposed", False)

    def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = x @ weight if transposed else F.linear(x, weight)
        return out if bias is None else out + bias

    def run(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outputs = []
        for e, x in enumerate(rows.split(counts)):
            if x.shape[0]:
                hidden = module._apply_gate(
                    project(x, gate_up[e], None if gate_up_bias is None else gate_up_bias[e])
                )
                outputs.append(project(hidden, down[e], None if down_bias is None else down_bias[e]))
        if outputs:
            return torch.cat(outputs)
        # no row reached this rank's experts: an empty output still tied to the rows (every rank's backward then
        # runs the same all-to-alls) and to the weights (each gets a zero gradient, as on the other ranks)
        untouched = sum(p.sum() for p in (gate_up, down, gate_up_bias, down_bias) if p is not None)
        return rows * 0 + 0 * untouched

    return run


def routed_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    group: ExpertGroup | None,
) -> torch.Tensor:
    """transformers' experts forward over sorted token copies: through `group` (expert parallel), or here (None)."""
    local = _local(module.gate_up_proj).shape[0]
    num_experts = local * (group.size if group is not None else 1)
    flat = top_k_index.reshape(-1)
    # an index of num_experts masks a copy (transformers skips it)
    kept = (flat < num_experts).nonzero().squeeze(1)
    order = kept[torch.argsort(flat[kept], stable=True)]
    token = order // top_k_index.shape[-1]
    counts = torch.bincount(flat[order], minlength=num_experts)
    compute = experts_fn(module)
    if group is None:
        rows = compute(hidden_states[token], counts.tolist())
    else:
        weights = (_local(module.gate_up_proj), _local(module.down_proj))
        rows = dispatch_compute_combine(hidden_states[token], counts, *weights, group, experts=compute)
    weighted = rows * top_k_weights.reshape(-1)[order, None].to(rows.dtype)
    return torch.zeros_like(hidden_states).index_add_(0, token, weighted.to(hidden_states.dtype))


def _forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts module's forward (each family's MoE block passes the three positionally): through its
    expert-parallel group where one is set, else transformers' own."""
    group = getattr(self, "expert_group", None)
    if group is None:
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    return routed_forward(self, hidden_states, top_k_index, top_k_weights, group)


def dispatch(model: nn.Module) -> list[str]:
    """Route every transformers experts module of `model` that holds an `expert_group` through it; their names."""
    routed = []
    for name, module in model.named_modules():
        if getattr(module, "expert_group", None) is None or "gate_up_proj" not in module._parameters:
            continue  # not split, or the built-in GPT's MoE block (its own forward dispatches)
        if not is_hf_experts(module):  # the rules admit only families this reproduces
            raise ValueError(f"{name} ({type(module).__name__}): an experts computation not routed here.")
        module.forward = types.MethodType(_forward, module)
        routed.append(name)
    return routed
