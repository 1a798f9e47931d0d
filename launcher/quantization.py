"""The quantization group: low-bit weights for the model's linear layers."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("none",)


@dataclass(frozen=True, kw_only=True)
class QuantizationConfig:
    """How the model's linear-layer weights are stored."""

    method: str = "none"
    """none: full-precision weights."""
