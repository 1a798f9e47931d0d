"""What a Hugging Face family's attention does, and which of the launcher's paths reproduce it (no torch).

transformers computes a family's attention with its own masks: causal, a sliding window on some or all
layers (Mistral, Qwen2/3 with use_sliding_window, Gemma-2/3's local layers, Phi-3), logit softcapping
(Gemma-2). The launcher's paths must give the same logits on packed rows as transformers gives on each
document alone:

- sdpa (the dense path) hands transformers the position ids and lets it build its own masks, so it is
  transformers' computation; families whose attention SDPA cannot run (Gemma-2's softcap: transformers
  offers no SDPA for it, and SDPA would drop a softcap a config sets) take transformers' eager path
  with the same masks instead;
- varlen is the launcher's own per-document attention; it honours sliding windows and softcaps, and is
  checked against transformers for the families in VARLEN_FAMILIES. A family outside it, or a config
  with attention features the path does not reproduce, takes the dense path under `auto` and is refused
  for `model.attention=varlen` before launch;
- flex is transformers' FlexAttention (its masks, its softcap), for the families that implement it.

The stage forward of a pipeline (launcher.components.model.hf_stage) is checked for PIPELINE_FAMILIES.
tests/unit/test_family_logits.py holds both lists to transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VARLEN_FAMILIES = frozenset(
    {
        "llama", "mistral", "ministral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
        "olmo3", "gpt2", "granite", "starcoder2", "cohere2", "smollm3", "mixtral", "qwen3_moe",
    }
)  # fmt: skip
"""model_types whose attention (windows and softcaps included) model.attention=varlen reproduces."""
PIPELINE_FAMILIES = frozenset(
    {
        "llama",
        "mistral",
        "ministral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "phi3",
        "olmo2",
        "olmo3",
        "mixtral",
        "qwen3_moe",
    }
)
"""model_types whose forward the pipeline stages repeat exactly (embedding, per-layer masks, norm, head)."""
UNHONOURED = {
    "use_bidirectional_attention": "bidirectional attention",
    "attention_chunk_size": "chunked attention",
}
"""Config keys whose attention the varlen path does not reproduce (transformers' own masks do)."""


@dataclass(frozen=True)
class FamilyAttention:
    """How one transformers family attends, as the launcher's attention paths need to know it."""

    model_type: str
    """config.model_type (llama, gemma2, ...)."""
    dense: str
    """transformers' attn_implementation for the dense path: sdpa, or eager where SDPA cannot run it."""
    flex: bool
    """Whether the family implements transformers' FlexAttention."""
    varlen_problem: str | None
    """Why model.attention=varlen would not compute what transformers computes (None: it does)."""
    pipeline_problem: str | None
    """Why pipeline stages would not repeat the family's forward exactly (None: they do)."""


def causal_lm_class(config: Any) -> type | None:
    """The transformers class AutoModelForCausalLM builds for `config` (None: not a causal LM transformers ships)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    return getattr(transformers, name, None) if isinstance(name, str) else None


def family_attention(config: Any, model_class: type | None = None) -> FamilyAttention:
    """The attention facts of the family `config` belongs to (`model_class`: its causal LM class, if built)."""
    cls = model_class or causal_lm_class(config)
    kind = config.model_type
    softcap = getattr(config, "attn_logit_softcapping", None)
    sdpa = bool(getattr(cls, "_supports_sdpa", False)) and softcap is None
    features = [what for key, what in UNHONOURED.items() if getattr(config, key, None)]
    varlen_problem = None
    if kind not in VARLEN_FAMILIES:
        varlen_problem = (
            f"the launcher's per-document attention is checked against transformers for "
            f"{', '.join(sorted(VARLEN_FAMILIES))}; model_type {kind!r} is not among them"
        )
    elif features:
        varlen_problem = (
            f"this {kind} config asks for {' and '.join(features)}, which the per-document path does not do"
        )
    pipeline_problem = None
    if kind not in PIPELINE_FAMILIES or features:
        pipeline_problem = (
            f"pipeline stages repeat a family's forward and are checked against transformers for "
            f"{', '.join(sorted(PIPELINE_FAMILIES))}; this {kind} model is not among them"
        )
    return FamilyAttention(
        model_type=kind,
        dense="sdpa" if sdpa else "eager",
        flex=bool(getattr(cls, "_supports_flex_attn", False)),
        varlen_problem=varlen_problem,
        pipeline_problem=pipeline_problem,
    )
