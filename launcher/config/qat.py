"""Schema of the qat group: quantization-aware training with torchao's fake quantizers, switched on at qat.start_step.

What the group builds at run time lives in launcher.components.qat.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMES = ("none", "int8_dynact_int4_weight", "int4_weight")
SCALE_BYTES = 4
"""Bytes per fake-quant scale (fp32; the zero point, int32, is as large): one of each per group."""


@dataclass(frozen=True, kw_only=True)
class QatConfig:
    """Quantization-aware training: which fake quantization the blocks' linear layers train under, from when."""

    scheme: str = "none"
    """none, int8_dynact_int4_weight (int8 per-token activations, int4 grouped weights) or int4_weight (weights only)."""
    group_size: int = 32
    """Weights per int4 scale along each row (must divide every quantized layer's in-features)."""
    start_step: int = 0
    """Optimizer step from which fake quantization is on (0: from the start; a delay lets the float model settle)."""
