"""Schema of the optimizer group: schema, parameter groups and the table of optimizer builders.

What the group builds at run time lives in launcher.components.optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Which optimizer updates the weights, and its hyper-parameters."""

    name: str = "adamw"
    """An option of the optimizer group (see OPTIMIZERS)."""
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
    """torch kernel choice: auto (fused AdamW on CUDA and CPU, fused SGD on CUDA, foreach otherwise),
    fused, foreach or for_loop."""


FUSED_AUTO_DEVICES = {"adamw": ("cuda", "cpu"), "sgd": ("cuda",)}
"""Where `implementation=auto` picks torch's fused kernel, per optimizer. AdamW's CPU kernel (torch >= 2.4,
float32/64, bfloat16 and float16, plain tensors and DTensors) is one vectorized pass over each
tensor, where foreach launches several ops per tensor list; Hugging Face Trainer picks it too."""


BNB_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit", "lion_8bit")
"""The options whose state bitsandbytes keeps in 8 bits (block-wise quantized)."""
