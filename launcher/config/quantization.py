"""Schema of the quantization group: int8 / nf4 weights for the model's linear layers, and LoRA adapters.

What the group builds at run time lives in launcher.components.quantization.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from launcher.config.adapters import LoRAConfig

METHODS = ("none", "int8", "nf4")
NF4_BACKENDS = ("auto", "bitsandbytes", "torchao")
# Linear layers that stay full precision whatever the method: the output head (often tied).
KEEP_FULL_PRECISION = ("lm_head",)


@dataclass(frozen=True, kw_only=True)
class QuantizationConfig:
    """How the model's linear-layer weights are stored, and which adapters train."""

    method: str = "none"
    """none (full precision), int8 (bitsandbytes LLM.int8) or nf4 (bitsandbytes 4-bit NormalFloat)."""
    double_quant: bool = True
    """nf4 (bitsandbytes): quantize the per-block scales too (about 0.4 bit per weight less; torchao always does)."""
    nf4_backend: str = "auto"
    """nf4 store: bitsandbytes, torchao (NF4Tensor, shardable by FSDP2) or auto (torchao under parallel=fsdp, else bitsandbytes)."""
    int8_threshold: float = 6.0
    """int8: activation magnitude above which a feature goes through the fp16 outlier path (0: none)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
