"""model.attention=flash_attention_2 (Hugging Face's name for the flash_attn package's kernels), judged
with what torch's own attention already does, before anything starts.

The launcher's attention paths (auto, sdpa, varlen, flex; launcher.components.model.attention) run
torch's kernels: on CUDA, SDPA dispatches causal attention without a mask to its flash kernel, and
packed documents go through per-document spans (varlen) or a FlexAttention block mask (flex).
flash_attention_2 is taken where transformers can run it: a Hugging Face model whose family has it,
on CUDA, with the flash_attn package installed, in bf16 or fp16, without pipeline stages (which
repeat the family's own attention masks); transformers then gets attn_implementation="flash_attention_2"
(launcher.components.model.hf_attention) and finds packed documents from the position ids itself.
Everywhere else it is refused with that explanation and the path to use.
"""

from __future__ import annotations

from collections.abc import Iterator

from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, installed
from launcher.spec import RunSpec, SpecError

FLASH = "flash_attention_2"

WHAT_SDPA_DOES = (
    "model.attention=auto already runs torch's fused kernels where the family allows: on CUDA, SDPA "
    "dispatches causal attention without a mask to its flash kernel, and packed documents (data.packing "
    "with data.document_mask) go through varlen (causal SDPA per document span) or flex (a FlexAttention "
    "block mask), so no flash_attn package is needed. Use model.attention=auto (or sdpa, varlen, flex)."
)


def asks_flash(choice: str) -> bool:
    """Whether `choice` names the flash_attn package's kernels (flash_attention_2, flash_attn, ...)."""
    return choice.startswith("flash")


def _why_not(spec: RunSpec, device_type: str) -> str | None:
    """Why flash_attention_2 cannot run for this spec, or None where it can."""
    if spec.model.kind != "hf":
        return "it is Hugging Face's name for the flash_attn package's kernels, and the built-in GPT has its own attention"
    if device_type != "cuda":
        return f"the flash_attn package's kernels run on CUDA only, and this run's device is {device_type}"
    if not installed("flash_attn"):
        return "the flash_attn package is not installed here"
    if not (spec.precision.bf16 or spec.precision.fp16):
        return "its kernels take bf16 or fp16 only, and this run computes in fp32 (precision=bf16 would do)"
    if spec.parallel.pp_size > 1:
        return (
            "pipeline stages repeat the family's own attention masks, which flash_attention_2 does not build"
        )
    return _family_lacks_it(spec)


def _family_lacks_it(spec: RunSpec) -> str | None:
    """Why the model's transformers family has no flash_attention_2 (None: it has; an unreadable config is
    another rule's to report)."""
    from launcher.components.model.hf_family import causal_lm_class
    from launcher.components.model.hf_files import hf_config

    try:
        config = hf_config(spec.model)
    except Exception:  # noqa: BLE001 - a folder or preset problem: the hf_model rules name it
        return None
    family = causal_lm_class(config)
    if family is not None and not getattr(family, "_supports_flash_attn", False):
        return f"transformers' {family.__name__} has no flash_attention_2"
    return None


def _flash_attention(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    choice = spec.model.attention
    if not asks_flash(choice):
        return
    if choice != FLASH:
        yield SpecError(("model.attention",), f"there is no attention path '{choice}'. {WHAT_SDPA_DOES}")
        return
    reason = _why_not(spec, hw.device_type)
    if reason is not None:
        yield SpecError(("model.attention",), f"{FLASH} is refused: {reason}. {WHAT_SDPA_DOES}")


RULES: tuple[Rule, ...] = (_flash_attention,)
