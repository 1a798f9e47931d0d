"""Schema of the precision group: autocast dtype, stored dtype, loss scaling for fp16, TF32, eval precision.

What the group builds at run time lives in launcher.components.precision.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes eval_dtype may name (torch's own names)."""
PARAM_DTYPES = ("fp32", "bf16")
"""The dtypes param_dtype may name: where weights, gradients and optimizer state are stored."""
FP8_RECIPES = ("tensorwise", "rowwise")
"""torchao.float8 scaling recipes precision.fp8_recipe may name (Float8LinearConfig.from_recipe_name)."""
FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability with float8 tensor cores (Ada, Hopper and newer)."""


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """How numbers are represented during training and evaluation."""

    bf16: bool = False
    """Run forward and loss under bf16 autocast (weights and optimizer state stay fp32)."""
    fp16: bool = False
    """Run forward and loss under fp16 autocast with dynamic loss scaling."""
    tf32: bool = False
    """Allow TF32 tensor-core matmuls and convolutions for fp32 work (NVIDIA Ampere or newer)."""
    eval_dtype: str | None = None
    """Autocast dtype for evaluation (float32, bfloat16, float16); null: the training dtype."""
    loss_scale_init: float = 65536.0
    """Initial loss scale for fp16."""
    loss_scale_growth_interval: int = 2000
    """Steps without overflow before the fp16 loss scale doubles."""
    fp8: bool = False
    """Swap linear layers for torchao float8 training layers (matmuls in fp8; needs a GPU of compute capability 8.9+)."""
    fp8_recipe: str = "tensorwise"
    """fp8 scaling: tensorwise (one scale per tensor, fastest) or rowwise (a scale per row, more accurate)."""
    param_dtype: str = "fp32"
    """Stored dtype of weights, gradients and optimizer state: fp32 (master weights) or bf16 (pure bf16, stochastic rounding)."""
    eval_cast: bool = False
    """Evaluate with the weights cast to the eval dtype (a copy; the training weights are untouched), not only autocast."""
