"""Schema of loRA (and DoRA) adapters through peft: the `quantization.lora` schema, injection, adapter-only state.

What the group builds at run time lives in launcher.components.adapters.
"""

from __future__ import annotations

from dataclasses import dataclass

ADAPTER = "default"
"""peft's name of our one adapter (it appears in state-dict keys: `lora_A.default.weight`)."""
QUANTIZED_FLAGS = {"int8": "is_loaded_in_8bit", "nf4": "is_loaded_in_4bit"}
"""The model attribute through which peft chooses its bitsandbytes LoRA layers, per quantization method."""


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Low-rank adapters added to linear layers; with them only the adapters train."""

    rank: int = 0
    """Rank r of each adapter (B @ A with A: r x in, B: out x r); 0 adds no adapters."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank (alpha / sqrt(rank) with rslora)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (training only)."""
    targets: list[str] | None = None
    """Module-name suffixes to adapt (e.g. [q_proj, v_proj]); null: every linear layer of the blocks."""
    dora: bool = False
    """DoRA: also train a magnitude per output row of each adapted weight (peft's use_dora)."""
    rslora: bool = False
    """Rank-stabilized LoRA: scale by alpha / sqrt(rank) instead of alpha / rank (peft's use_rslora)."""
