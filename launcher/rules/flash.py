"""model.attention=flash_attention_2 (Hugging Face's name for the flash_attn package's kernels), judged
with what torch's own attention already does, before anything starts.

The launcher's attention paths (auto, sdpa, varlen, flex; launcher.components.model.attention) all
run torch's kernels: on CUDA, SDPA dispatches causal attention without a mask to its flash kernel,
and packed documents go through per-document spans (varlen) or a FlexAttention block mask (flex).
flash_attention_2 is taken only where it can run as transformers runs it: a Hugging Face model,
CUDA, the flash_attn package installed, and an attention path of that name in the launcher's options
(config.model.ATTENTION); everywhere else it is refused with that explanation and the path to use.
"""

from __future__ import annotations

from collections.abc import Iterator

from launcher.config.model import ATTENTION
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, installed
from launcher.spec import RunSpec, SpecError

FLASH = "flash_attention_2"

WHAT_SDPA_DOES = (
    "model.attention=auto already runs torch's fused kernels: on CUDA, SDPA dispatches causal attention "
    "without a mask to its flash kernel, and packed documents (data.packing with data.document_mask) go "
    "through varlen (causal SDPA per document span) or flex (a FlexAttention block mask), so no flash_attn "
    "package is needed. Use model.attention=auto (or sdpa, varlen, flex)."
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
    if FLASH not in ATTENTION:
        return "this launcher's Hugging Face models take torch's attention paths only"
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
