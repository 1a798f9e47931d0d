"""4-bit NormalFloat weights that FSDP2 can shard: torchao's NF4Tensor in place of bitsandbytes' Params4bit.

bitsandbytes packs a 4-bit matrix and keeps its scales in a side object (`quant_state`), so a
sharding strategy that splits parameters along their first dimension loses the scales. torchao's
`NF4Tensor` is a tensor subclass whose packed codes, block scales and double-quantized scale
factors split and all-gather together, which is what torchtune's FSDP2 QLoRA relies on. A layer
stays an `nn.Linear`; only its frozen weight becomes an NF4Tensor (F.linear dequantizes it on use),
so peft's LoRA wraps it like any linear layer.

NF4 here quantizes blocks of 64 weights with one scale each, and those scales in blocks of 256
(double quantization), so a matrix must hold a multiple of 64 x 256 = 16384 weights, and under
FSDP2 each rank's share of rows must still be a whole number of those blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where a rank quantizes: the rules read the block sizes without it
    import torch
    from torch import nn

BLOCK_SIZE = 64
"""Weights per scale."""
SCALER_BLOCK_SIZE = 256
"""Scales per double-quantization factor."""
GROUP = BLOCK_SIZE * SCALER_BLOCK_SIZE
"""Weights per double-quantization factor: a quantized matrix holds a multiple of this."""


def torchao_quantization() -> Any:
    """`torchao.quantization`, imported on first use (its CPU-machine notices are silenced in launcher/__init__)."""
    import torchao.quantization

    return torchao.quantization


def shape_problem(name: str, out_features: int, in_features: int, num_shards: int = 1) -> str | None:
    """Why a (out x in) matrix cannot be stored as NF4 split over `num_shards` row shards; None if it can."""
    numel = out_features * in_features
    if numel % GROUP:
        return f"{name} ({out_features} x {in_features}) holds {numel} weights, not a multiple of {GROUP}"
    if out_features % num_shards or (numel // GROUP) % num_shards:
        return (
            f"{name} ({out_features} x {in_features}) cannot be split into {num_shards} row shards of whole "
            f"{GROUP}-weight NF4 groups"
        )
    return None


def quantize_linear(linear: nn.Linear) -> nn.Linear:
    """`linear` with its weight frozen as a torchao NF4Tensor (same module, bias kept as is)."""
    from torch import nn

    ao = torchao_quantization()
    weight = linear.weight.detach()
    problem = shape_problem("this layer", *weight.shape)
    if problem:
        raise ValueError(f"{problem}; quantization.method=nf4 with torchao cannot store it.")
    nf4 = ao.to_nf4(weight.contiguous(), block_size=BLOCK_SIZE, scaler_block_size=SCALER_BLOCK_SIZE)
    linear.weight = nn.Parameter(nf4, requires_grad=False)
    if linear.bias is not None:
        linear.bias.requires_grad_(False)
    return linear


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a torchao NF4Tensor (a local shard of a DTensor counts)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return type(local).__name__ == "NF4Tensor"


def dequantize(weight: torch.Tensor) -> torch.Tensor:
    """The float32 matrix an NF4Tensor stores."""
    return weight.get_original_weight().float()
