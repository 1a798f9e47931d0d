"""Frozen routed experts stored as torchao NF4 tensors (QLoRA on a Mixture-of-Experts model, FSDP2-shardable).

The experts are stacked 3-D parameters: transformers 5's `mlp.experts.gate_up_proj` [E, 2F, D] and
`down_proj` [E, D, F], the built-in GPT's `w_up` [E, d, f] and `w_down` [E, f, d]. torchao's NF4Tensor is 2-D
only (and has no indexing, batched matmul or transpose beyond 2-D), so each becomes one NF4Tensor of the
stacked rows, [E x rows, cols]: expert e's rows stay contiguous, FSDP2 splits it along dim 0 (whole experts
per shard when E divides by the ranks) and all-gathers it with its scales as for linear layers.

The experts' own forward is left as it is: a forward pre-hook shows it, under the parameter's name, the
dequantized [E, rows, cols] tensor (an instance attribute wins over the module's parameters, as in
launcher.components.model.hf_local_experts), and a forward hook takes it away. The dequantized weights are
a constant to autograd (the base is frozen), so the layer's matmuls keep them for their input gradients
until its backward; activation checkpointing (memory.activation_checkpointing=blocks) recomputes them there
instead. A parameter LoRA adapts (peft's target_parameters) stays in full precision: peft's per-expert
wrapper reads a 3-D parameter.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from launcher.components import nf4
from launcher.config.model import ModelConfig

if TYPE_CHECKING:  # torch only where a rank quantizes
    import torch
    from torch import nn

HF_EXPERTS = ("gate_up_proj", "down_proj")
"""transformers' fused expert tensors (biases, where a family has them, stay in full precision)."""
GPT_EXPERTS = ("w_up", "w_down")
"""The built-in GPT's stacked expert weights (launcher.components.model.moe)."""
ROUTERS = (".router.gate",)
"""The built-in GPT's routers (nn.Linear, E rows): kept in full precision, as transformers' routers (not linear
layers) are; routing is sensitive to small errors and a router is smaller than one NF4 group."""
SHAPES = "nf4_expert_shapes"
"""The attribute of a quantized experts module: parameter name -> its 3-D shape."""


def expert_sites(model: nn.Module) -> dict[str, tuple[nn.Module, tuple[str, ...]]]:
    """Module name -> (module, its stacked 3-D expert parameters) for every routed-experts site of `model`."""
    from launcher.components.model.moe import MoE

    sites = {}
    for name, module in model.named_modules():
        names = GPT_EXPERTS if isinstance(module, MoE) else HF_EXPERTS
        held = tuple(n for n in names if getattr(module._parameters.get(n), "ndim", 0) == 3)
        if held and (isinstance(module, MoE) or name.rsplit(".", 1)[-1] == "experts"):
            sites[name] = (module, held)
    return sites


def stacked_shape_problem(name: str, shape: tuple[int, int, int], num_shards: int = 1) -> str | None:
    """Why a stacked [E, rows, cols] expert tensor cannot be NF4 over `num_shards` FSDP2 shards; None if it can."""
    experts, rows, cols = shape
    return nf4.shape_problem(name, experts * rows, cols, num_shards)


def quantize_experts(
    model: nn.Module, *, keep: Collection[str] = (), device: str | torch.device = "cpu"
) -> list[str]:
    """Store every expert parameter of `model` (but those named in `keep`) as a frozen NF4Tensor on `device`; their names."""
    done = []
    for site, (module, names) in expert_sites(model).items():
        chosen = [n for n in names if f"{site}.{n}" not in keep]
        if chosen:
            _quantize_site(module, chosen, device)
            done += [f"{site}.{n}" for n in chosen]
    return done


def _quantize_site(module: nn.Module, names: list[str], device: str | torch.device) -> None:
    """One experts module: its chosen 3-D parameters as 2-D NF4Tensors, shown dequantized to its forward."""
    from torch import nn

    ao = nf4.torchao_quantization()
    shapes = {}
    for name in names:
        weight = module._parameters[name].detach().to(device)
        shapes[name] = tuple(weight.shape)
        problem = stacked_shape_problem(name, shapes[name])
        if problem:
            raise ValueError(f"{problem}; torchao's NF4 cannot store these experts.")
        flat = weight.reshape(-1, weight.shape[-1]).contiguous()
        stored = ao.to_nf4(flat, block_size=nf4.BLOCK_SIZE, scaler_block_size=nf4.SCALER_BLOCK_SIZE)
        module.register_parameter(name, nn.Parameter(stored, requires_grad=False))
    setattr(module, SHAPES, shapes)
    module.register_forward_pre_hook(_show_dequantized)
    module.register_forward_hook(_hide_dequantized)


def _show_dequantized(module: nn.Module, args: Any) -> None:
    """The forward reads each NF4 expert parameter as its dequantized [E, rows, cols] tensor."""
    for name, shape in getattr(module, SHAPES).items():
        module.__dict__[name] = dequantized(module._parameters[name], shape)


def _hide_dequantized(module: nn.Module, args: Any, output: Any) -> Any:
    """The parameters visible again after the forward (the dequantized copies dropped)."""
    for name in getattr(module, SHAPES):
        module.__dict__.pop(name, None)
    return output


def dequantized(weight: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The [E, rows, cols] tensor a stacked NF4 expert parameter stores (its local tensor if a DTensor)."""
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return local.get_original_weight().view(shape)


def dequantized_experts(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full name -> the float32 [E, rows, cols] tensor of every NF4 expert parameter of `model` (for merges)."""
    out = {}
    for site, module in model.named_modules():
        for name, shape in (getattr(module, SHAPES, None) or {}).items():
            out[f"{site}.{name}" if site else name] = dequantized(module._parameters[name], shape).float()
    return out


def stacked_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """The 3-D expert tensors of one MoE layer of the model `cfg` describes (empty for a dense one), from its keys
    or config.json: transformers' gate_up_proj [E, 2F, D] and down_proj [E, D, F], or the GPT's w_up and w_down."""
    if cfg.kind == "gpt":
        from launcher.config.model import expert_width

        e, d, f = cfg.moe.num_experts, cfg.d_model, expert_width(cfg)
        return {"w_up": (e, d, f), "w_down": (e, f, d)} if e else {}
    from launcher.components.model.hf_experts import num_experts
    from launcher.components.model.hf_files import hf_config

    config = hf_config(cfg)
    e, d = num_experts(config), config.hidden_size
    f = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return {"experts.gate_up_proj": (e, 2 * f, d), "experts.down_proj": (e, d, f)} if e else {}
