"""Rules of the quantization group (int8 / nf4 weights, LoRA/DoRA adapters through peft), checked before anything starts."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

from launcher.groups.model.hf import PRESET_LINEARS, is_preset
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError

# The linear layers of the built-in GPT's blocks (launcher.groups.model.gpt), by name suffix.
GPT_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "up", "down")
# Strategies that shard or re-lay out the weights themselves, which bitsandbytes layers do not support.
WEIGHT_SHARDING = ("fsdp", "tp")


def model_linears(spec: RunSpec) -> tuple[str, ...] | None:
    """Name suffixes of the model's quantizable linear layers; None when only building it would tell."""
    m = spec.model
    if m.kind == "gpt":
        return GPT_LINEARS
    if m.kind == "hf" and is_preset(m.hf_config):
        return PRESET_LINEARS[m.hf_config]
    return None


def _quantized_needs_adapters(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    q = spec.quantization
    if q.method != "none" and q.lora.rank == 0:
        yield SpecError(
            ("quantization.method", "quantization.lora.rank"),
            f"{q.method} weights are frozen (bitsandbytes stores them as integers), so without adapters "
            f"nothing in the blocks would train. Add LoRA adapters: `quantization={q.method}_lora` "
            "(or quantization.lora.rank=16), or use `quantization=none` for full training.",
        )
    if q.method != "none" and importlib.util.find_spec("bitsandbytes") is None:
        yield SpecError(
            ("quantization.method",),
            f"quantization.method={q.method} needs bitsandbytes, which is not installed. "
            "Install it with `pip install -e '.[bnb]'` (or `pip install bitsandbytes`).",
        )
    if q.int8_threshold < 0:
        yield SpecError(
            ("quantization.int8_threshold",),
            f"must be 0 or more (0 turns the fp16 outlier path off; 6.0 is LLM.int8's), got {q.int8_threshold}.",
        )


def _lora_settings(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    lora = spec.quantization.lora
    if lora.rank < 0:
        yield SpecError(("quantization.lora.rank",), f"must be 0 (no adapters) or more, got {lora.rank}.")
    if lora.rank == 0:
        return
    if lora.alpha <= 0:
        yield SpecError(
            ("quantization.lora.alpha",),
            f"must be positive (adapter scale = alpha / rank), got {lora.alpha}.",
        )
    if not 0.0 <= lora.dropout < 1.0:
        yield SpecError(("quantization.lora.dropout",), f"must lie in [0, 1), got {lora.dropout}.")
    if importlib.util.find_spec("peft") is None:
        yield SpecError(
            ("quantization.lora.rank",),
            "LoRA adapters are built by peft, which is not installed. Install it with "
            "`pip install -e '.[hf]'` (or `pip install peft`), or use quantization.lora.rank=0.",
        )
    yield from _lora_targets(spec)
    yield from _dora(spec)


def _dora(spec: RunSpec) -> Iterator[SpecError]:
    q = spec.quantization
    if q.lora.dora and q.method == "int8":
        yield SpecError(
            ("quantization.lora.dora", "quantization.method"),
            "DoRA on int8 weights fails in peft 0.21 with bitsandbytes 0.50: to take the weight's norm, peft "
            "dequantizes the int8 layer and re-creates its weight, which loses the row scales, so the "
            "second forward pass breaks (seen on the CPU). Use DoRA on nf4 (`quantization=nf4_lora "
            "quantization.lora.dora=true`) or full-precision weights (`quantization=dora`), or plain LoRA on int8.",
        )


def _lora_targets(spec: RunSpec) -> Iterator[SpecError]:
    targets = spec.quantization.lora.targets
    if targets is None:
        return
    if not targets:
        yield SpecError(
            ("quantization.lora.targets",),
            "an empty list adapts nothing. Name layers, e.g. [q_proj,v_proj], or use null for every "
            "linear layer of the blocks.",
        )
        return
    known = model_linears(spec)  # None for a local model: the build checks its layers (same message)
    unknown = [t for t in targets if known is not None and t.rsplit(".", 1)[-1] not in known]
    if unknown:
        yield SpecError(
            ("quantization.lora.targets", "model.kind"),
            f"{', '.join(unknown)} {'matches' if len(unknown) == 1 else 'match'} none of this model's adaptable "
            f"linear layers ({', '.join(known)}); embeddings and the output head (tied to the token "
            "embedding) stay full precision and untargeted. Choose from that list, or use null for all.",
        )


def _strategies(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    q, p = spec.quantization, spec.parallel
    if q.method != "none" and (
        p.strategy in WEIGHT_SHARDING or (p.strategy == "deepspeed" and p.zero_stage == 3)
    ):
        how = f"parallel.strategy={p.strategy}" + (
            f" with zero_stage={p.zero_stage}" if p.strategy == "deepspeed" else ""
        )
        yield SpecError(
            ("quantization.method", "parallel.strategy", "parallel.zero_stage"),
            f"{q.method} weights cannot be sharded by {how}: bitsandbytes keeps each quantized matrix "
            "with its scales as one packed tensor. Use `parallel=ddp` or DeepSpeed ZeRO 0-2 (they "
            "replicate the frozen quantized weights and shard only what trains), or `quantization=lora`.",
        )
    if q.lora.rank > 0 and p.strategy == "tp":
        yield SpecError(
            ("quantization.lora.rank", "parallel.strategy"),
            "tensor parallelism shards the q/k/v/o and MLP projections that LoRA wraps, so the two do not "
            "combine. Use `parallel=ddp` (or another data-parallel strategy) with LoRA, or drop the adapters.",
        )


RULES: tuple[Rule, ...] = (_quantized_needs_adapters, _lora_settings, _strategies)
"""This module's rules, in the order they report."""
