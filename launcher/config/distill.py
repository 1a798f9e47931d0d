"""Schema of the distill group: knowledge distillation from a frozen teacher, and the chunked KL term of the loss.

What the group builds at run time lives in launcher.components.objectives.distillation.
"""

from __future__ import annotations

from dataclasses import dataclass

LOSSES = ("forward_kl", "reverse_kl")
MODES = ("offline", "on_policy")
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
    mode: str = "offline"
    """offline: the data's tokens (CE + KD); on_policy: the student's own sampled completions, scored by the teacher (GKD)."""
    lmbda: float = 1.0
    """on_policy: share of steps whose completions the student samples (else the data's own), in [0, 1]; 1: fully on-policy."""
    beta: float = 1.0
    """on_policy: generalised JSD interpolation in [0, 1]: 0 KL(teacher || student), 1 KL(student || teacher)."""
    max_new_tokens: int = 32
    """on_policy: most tokens sampled after each prompt (prompt tokens + this must fit data.seq_len)."""
    prompt_tokens: int = 16
    """on_policy: a prompt is a record's untrained prefix (instruction, chat) or else its first prompt_tokens tokens."""
    sampling_temperature: float = 1.0
    """on_policy: temperature the student samples at (0: greedy)."""
    top_k: int = 0
    """on_policy: sample among the k most likely tokens only (0: no limit)."""
    top_p: float = 1.0
    """on_policy: sample from the smallest nucleus whose probability reaches top_p."""
    eval_prompts: int = 16
    """on_policy: held-out prompts the eval's student-teacher KL is measured on (at each evaluation)."""

    @property
    def on_policy(self) -> bool:
        """Whether the student learns from its own samples (distill.mode=on_policy with a teacher)."""
        return self.teacher is not None and self.mode == "on_policy"
