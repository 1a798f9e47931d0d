"""The qat group: quantization-aware training with torchao's fake quantizers, switched on at qat.start_step.

`prepare` runs in launcher.rank.build right after the model is built (and after quantization.apply,
which the rules keep at method=none): torchao's `quantize_(model, QATConfig(base, step="prepare"))`
swaps the blocks' nn.Linear layers for FakeQuantizedLinear, whose forward rounds the weights (and,
for int8_dynact_int4_weight, the activations) to the target grid while gradients flow straight
through to the float weights. It must come before tensor parallelism, compile and the data-parallel
wrap: those take the module tree as they find it (DDP's buckets, FSDP2's shards, the compiled
graph), so the swap has to be done by then.

What a checkpoint must hold: torchao 0.18's fake quantizers are dynamic (scales and zero points are
recomputed from the weights on every forward and kept as plain attributes, not buffers), so a
prepared model's state dict has exactly the plain model's keys; the only state besides the weights
is the on/off switch, which is a pure function of the step (on from qat.start_step), and the step is
in trainer.pt. `switch_hook` sets it before every optimizer step, so a resume before or past
start_step continues bitwise.

`convert` turns a prepared model into the really quantized one (QATConfig(step="convert"):
IntxUnpackedToInt8Tensor weights) for `train-export --qat-convert`; `ptq` quantizes a plain model
with the same scheme (for the measurements in docs/compression.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from launcher.components.quantization import quantizable_linears
from launcher.config.qat import SCALE_BYTES, SCHEMES, QatConfig

if TYPE_CHECKING:  # torch and torchao only where a rank prepares the model
    from torch import nn


def base_config(cfg: QatConfig) -> Any:
    """The torchao post-training config QAT fakes during training and `convert` applies at the end."""
    import torch
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup

    if cfg.scheme == "int8_dynact_int4_weight":
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(cfg.group_size)
        )
    if cfg.scheme == "int4_weight":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(cfg.group_size))
    raise ValueError(f"qat.scheme={cfg.scheme!r}: choose one of {', '.join(SCHEMES)}.")


def _quantize(model: nn.Module, config: Any) -> None:
    """torchao's quantize_ on the layers quantization may replace (never the head or tied layers)."""
    with warnings.catch_warnings():  # torchao's import chatter (pytree deprecations), not the user's business
        warnings.simplefilter("ignore")
        from torchao.quantization import quantize_

        names = set(quantizable_linears(model))
        quantize_(model, config, filter_fn=lambda _module, fqn: fqn in names)


def fake_quantizers(model: nn.Module) -> list[nn.Module]:
    """The torchao fake quantizers (weights and activations) of a prepared model."""
    found = []
    for module in model.modules():
        for attr in ("weight_fake_quantizer", "activation_fake_quantizer"):
            quantizer = getattr(module, attr, None)
            if quantizer is not None:
                found.append(quantizer)
    return found


def set_enabled(model: nn.Module, enabled: bool) -> None:
    """Turn every fake quantizer of `model` on or off (torchao's own switch)."""
    for quantizer in fake_quantizers(model):
        quantizer.enabled = enabled


def prepare(model: nn.Module, cfg: QatConfig) -> nn.Module:
    """Swap the blocks' linear layers for torchao fake-quantized ones, switched on only if start_step is 0."""
    if cfg.scheme == "none":
        return model
    from torchao.quantization.qat import QATConfig

    bad = {
        name: layer.in_features
        for name, layer in quantizable_linears(model).items()
        if layer.in_features % cfg.group_size
    }
    if bad:  # the rules check the built-in GPT before launch; a Hugging Face model's widths are known here
        name, width = next(iter(bad.items()))
        raise ValueError(
            f"qat.group_size={cfg.group_size}: int4 weights get one scale per {cfg.group_size} inputs, but {name} has "
            f"{width} in-features, not a multiple of it. Choose a qat.group_size that divides every linear layer's "
            "in-features (e.g. 32)."
        )
    _quantize(model, QATConfig(base_config(cfg), step="prepare"))
    set_enabled(model, cfg.start_step == 0)
    return model


def switch_hook(model: nn.Module, cfg: QatConfig) -> Callable[[int], None] | None:
    """A before-step hook: fake quantization on for steps >= qat.start_step (None without QAT)."""
    if cfg.scheme == "none":
        return None
    state = {"enabled": cfg.start_step == 0}

    def switch(step: int) -> None:
        enabled = step >= cfg.start_step
        if enabled != state["enabled"]:
            set_enabled(model, enabled)
            state["enabled"] = enabled

    set_enabled(model, state["enabled"])
    return switch


def convert(model: nn.Module, cfg: QatConfig) -> nn.Module:
    """The really quantized model from a prepared one (torchao's QATConfig step="convert")."""
    from torchao.quantization.qat import QATConfig

    _quantize(model, QATConfig(base_config(cfg), step="convert"))
    return model


def ptq(model: nn.Module, cfg: QatConfig) -> nn.Module:
    """A plain (never fake-quantized) model quantized after training with the same scheme."""
    _quantize(model, base_config(cfg))
    return model


def scale_bytes(linear_shapes: list[tuple[int, int]], cfg: QatConfig) -> int:
    """Bytes of the weight scales and zero points the fake quantizers compute per forward ((out, in) shapes)."""
    if cfg.scheme == "none":
        return 0
    groups = sum(
        out_features * (in_features // cfg.group_size) for out_features, in_features in linear_shapes
    )
    return 2 * SCALE_BYTES * groups
