"""Schema of the distill group: knowledge distillation from a frozen teacher, and the chunked KL term of the loss.

What the group builds at run time lives in launcher.components.objectives.distillation.
"""

from __future__ import annotations

from dataclasses import dataclass

LOSSES = ("forward_kl", "reverse_kl")
KD_CHUNK_ROWS = 128
"""Token positions whose logits are upcast and compared at once (x the vocabulary, float32, per model)."""


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """Knowledge distillation: a frozen teacher whose next-token distributions the student also learns from."""

    teacher: str | None = None
    """null (no distillation), a run directory (its spec.yaml and newest checkpoint) or a local Hugging Face model folder."""
    kd_ratio: float = 0.5
    """Weight of the KD term: loss = (1 - kd_ratio) * cross-entropy + kd_ratio * KD, in [0, 1]."""
    temperature: float = 1.0
    """Softmax temperature of both models' logits in the KD term (> 0; the term is scaled by its square)."""
    loss: str = "forward_kl"
    """forward_kl: KL(teacher || student), mode covering; reverse_kl: KL(student || teacher), mode seeking."""
