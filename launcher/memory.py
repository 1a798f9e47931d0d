"""The memory group: techniques that trade compute for memory."""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATION_CHECKPOINTING = ("none",)


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """Memory-saving techniques applied to the model."""

    activation_checkpointing: str = "none"
    """none: keep every activation for the backward pass."""
