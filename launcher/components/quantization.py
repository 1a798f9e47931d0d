"""The quantization group: int8 / nf4 weights for the model's linear layers, and LoRA adapters.

`apply` runs between building the model and wrapping it in a strategy (see launcher.rank.build): it
replaces the linear layers of the transformer blocks by bitsandbytes layers (embeddings and the
output head, tied to the token embedding, stay full precision), then injects peft adapters into the
layers LoRA targets and freezes everything but the adapters (launcher.components.adapters). Quantized layers keep one weight layout on every device
(bitsandbytes' CPU inference repacking is lossy, so it is off) and their state dicts round-trip
through `load_state_dict`, so a checkpoint restores them bit for bit. `merged_state_dict` goes the
other way: adapters folded in, low-bit weights dequantized, a plain float32 state dict.

nf4 has two stores (`quantization.nf4_backend`): bitsandbytes' Linear4bit, or torchao's NF4Tensor as
the frozen weight of a plain nn.Linear (launcher.components.nf4), which FSDP2 can shard; `auto` takes
torchao under parallel=fsdp and bitsandbytes elsewhere. With torchao's store the frozen routed experts of a
Mixture-of-Experts model are NF4 too (launcher.components.nf4_experts), but those LoRA adapts.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from launcher.components import nf4
from launcher.components.adapters import (
    adapter_layers,
    add_adapters,
    expert_parameters,
    folded_weight,
    matches,
)
from launcher.config.adapters import ADAPTER
from launcher.config.parallel import method_of
from launcher.config.quantization import KEEP_FULL_PRECISION, METHODS, QuantizationConfig

if TYPE_CHECKING:  # torch only where a rank quantizes: the launching process never needs it
    import torch
    from torch import nn


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the submodule `name` was."""
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name), leaf, new)


def quantizable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers quantization and LoRA may replace: all but the head and embedding-tied ones."""
    from torch import nn

    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and name.rsplit(".", 1)[-1] not in KEEP_FULL_PRECISION
        and id(module.weight) not in embedding_weights
    }


def _make_layer_classes() -> tuple[type, type]:
    """The two bitsandbytes layer classes, defined on first use so bitsandbytes stays optional."""
    import bitsandbytes as bnb

    # LLM.int8 casts activations to fp16 to quantize them, by design; bitsandbytes logs that on
    # every call, which would bury the training log.
    logging.getLogger("bitsandbytes.autograd._functions").addFilter(
        lambda record: "inputs will be cast" not in record.getMessage()
    )

    class NF4Linear(bnb.nn.Linear4bit):
        """bnb.nn.Linear4bit (nf4) whose quantization state loads back through `load_state_dict`."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.support_avx512bf16_for_cpu = False  # that repacking re-rounds the scales to bf16

        def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
            stats_prefix = prefix + "weight."
            stats = {
                k[len(stats_prefix) :]: state_dict.pop(k)
                for k in list(state_dict)
                if k.startswith(stats_prefix)
            }
            if stats and prefix + "weight" in state_dict:
                self.weight = bnb.nn.Params4bit.from_prequantized(
                    state_dict[prefix + "weight"],
                    stats,
                    requires_grad=False,
                    device=self.weight.device,
                    module=self,
                )
            super()._load_from_state_dict(state_dict, prefix, *args)

    class Int8Linear(bnb.nn.Linear8bitLt):
        """bnb.nn.Linear8bitLt with frozen int8 weights (row-wise scales saved as `SCB`)."""

    return NF4Linear, Int8Linear


_LAYER_CLASSES: tuple[type, type] | None = None


def layer_classes() -> tuple[type, type]:
    """(NF4Linear, Int8Linear), the bitsandbytes layers this module builds."""
    global _LAYER_CLASSES
    if _LAYER_CLASSES is None:
        _LAYER_CLASSES = _make_layer_classes()
    return _LAYER_CLASSES


def quantize_linear(linear: nn.Linear, cfg: QuantizationConfig, dtype: torch.dtype, device: str) -> nn.Module:
    """A frozen bitsandbytes copy of `linear`, quantized on `device` (meta-built, so no RNG is used)."""
    import bitsandbytes as bnb
    from torch import nn

    nf4_cls, int8_cls = layer_classes()
    has_bias = linear.bias is not None
    shape = (linear.in_features, linear.out_features)
    if cfg.method == "nf4":
        layer = nf4_cls(
            *shape, bias=has_bias, compute_dtype=dtype, compress_statistics=cfg.double_quant,
            quant_type="nf4", device="meta",
        )  # fmt: skip
        layer.weight = bnb.nn.Params4bit(
            linear.weight.data, requires_grad=False, compress_statistics=cfg.double_quant,
            quant_type="nf4", module=layer,
        )  # fmt: skip
    elif cfg.method == "int8":
        layer = int8_cls(
            *shape, bias=has_bias, has_fp16_weights=False, threshold=cfg.int8_threshold, device="meta"
        )
        layer.weight = bnb.nn.Int8Params(linear.weight.data, requires_grad=False, has_fp16_weights=False)
    else:
        raise ValueError(f"quantization.method={cfg.method!r}: choose one of {', '.join(METHODS)}.")
    if has_bias:
        layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    return layer.to(device)


def is_quantized(module: nn.Module) -> bool:
    """Whether `module` is one of the bitsandbytes layers `quantize_linear` builds, or a linear layer with an NF4Tensor weight."""
    if _LAYER_CLASSES is not None and isinstance(module, _LAYER_CLASSES):
        return True
    from torch import nn

    return isinstance(module, nn.Linear) and nf4.is_nf4(module.weight)


def nf4_backend(cfg: QuantizationConfig, strategy: str) -> str:
    """Which library stores nf4 weights for a run of parallel.strategy `strategy` (FSDP2 shards torchao's)."""
    if cfg.nf4_backend != "auto":
        return cfg.nf4_backend
    return "torchao" if method_of(strategy).shards else "bitsandbytes"


def apply(
    model: nn.Module,
    cfg: QuantizationConfig,
    dtype: torch.dtype,
    *,
    device: str | torch.device = "cpu",
    strategy: str = "single",
) -> nn.Module:
    """Quantize the blocks' linear layers, then add peft LoRA adapters and freeze the rest (QLoRA).

    `dtype`: the training dtype, which bitsandbytes' quantized layers compute in. `strategy` is parallel.strategy
    or its data-parallel method (nf4_backend=auto asks whether it shards). Pure in the sense that
    matters for resume: the result depends only on `model`, the config and `dtype`, and on torch's global
    RNG for the adapters' initial A matrices.
    """
    if cfg.method == "none" and cfg.lora.rank == 0:
        return model
    linears = quantizable_linears(model)
    peft_sees = cfg.method
    if cfg.method == "nf4" and nf4_backend(cfg, strategy) == "torchao":
        from launcher.components import nf4_experts

        for name, linear in linears.items():
            if not name.endswith(nf4_experts.ROUTERS):  # a router's few rows stay full precision
                nf4.quantize_linear(linear.to(device))

        nf4_experts.quantize_experts(model, keep=adapted_expert_parameters(model, cfg), device=device)
        peft_sees = "none"  # a plain nn.Linear whose weight dequantizes itself in F.linear
    elif cfg.method != "none":
        for name, linear in linears.items():
            replace_module(model, name, quantize_linear(linear, cfg, dtype, str(device)))
    if cfg.lora.rank > 0:
        add_adapters(model, cfg.lora, list(linears), quantized=peft_sees)
    return model


def adapted_expert_parameters(model: nn.Module, cfg: QuantizationConfig) -> set[str]:
    """The fused expert tensors LoRA targets by name (peft adapts them per expert: they stay in full precision)."""
    if cfg.lora.rank == 0 or cfg.lora.targets is None:
        return set()
    return {n for n in expert_parameters(model) if any(matches(n, t) for t in cfg.lora.targets)}


def dequantized_weight(layer: nn.Module) -> torch.Tensor:
    """The float32 weight a plain, bitsandbytes or torchao-nf4 linear layer represents."""
    if nf4.is_nf4(layer.weight):
        return nf4.dequantize(layer.weight)
    if not is_quantized(layer):
        return layer.weight.detach().float()
    import bitsandbytes.functional as bnbf

    weight = layer.weight
    if hasattr(weight, "quant_state"):  # nf4
        return bnbf.dequantize_4bit(weight.data, weight.quant_state).float()
    codes = weight.CB if weight.CB is not None else layer.state.CB
    scales = weight.SCB if weight.SCB is not None else layer.state.SCB
    return bnbf.int8_vectorwise_dequant(codes, scales).float()


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A plain float32 state dict of `model` with adapters folded in and quantized weights dequantized.

    It loads into the same architecture built without quantization or adapters. The fold is ours
    (launcher.components.adapters.folded_weight, on peft's delta and DoRA norm) rather than peft's
    merge, which would quantize the merged weight back into the bitsandbytes layer.
    """
    import torch

    from launcher.components.nf4_experts import dequantized_experts

    with torch.no_grad():
        adapted = adapter_layers(model)
        experts = {
            name: adapted.pop(name) for name in list(adapted) if hasattr(adapted[name], "parameter_name")
        }
        special: dict[str, tuple[nn.Module, nn.Module | None]] = {
            name: (layer.get_base_layer(), layer) for name, layer in adapted.items()
        }
        for name, module in model.named_modules():
            if is_quantized(module) and not name.endswith(".base_layer"):
                special[name] = (module, None)
        prefixes = tuple(f"{name}." for name in special)
        nf4_experts = {k: v.cpu() for k, v in dequantized_experts(model).items()}  # NF4 experts, 3-D again
        state = {
            key: value.detach().float().cpu() if value.is_floating_point() else value.detach().cpu()
            for key, value in model.state_dict().items()
            if not key.startswith(prefixes) and key not in nf4_experts
        }
        state.update(nf4_experts)
        for name, (base, layer) in special.items():
            weight = dequantized_weight(base)
            state[f"{name}.weight"] = (folded_weight(layer, weight) if layer is not None else weight).cpu()
            if base.bias is not None:
                state[f"{name}.bias"] = base.bias.detach().float().cpu()
        return _fold_expert_adapters(state, experts)


def _fold_expert_adapters(
    state: dict[str, torch.Tensor], wrappers: dict[str, nn.Module]
) -> dict[str, torch.Tensor]:
    """`state` with peft's expert-parameter adapters (ParamWrapper) folded into the fused expert tensors.

    peft nests one wrapper per adapted tensor (`experts.base_layer.base_layer.gate_up_proj`): their keys
    lose the `.base_layer` steps and the adapters, and each tensor gains its delta [experts, out, in].
    """
    owners = {name: name.split(".base_layer")[0] for name in wrappers}
    prefixes = tuple(f"{owner}." for owner in owners.values())
    out = {}
    for key, value in state.items():
        if not key.startswith(prefixes):
            out[key] = value
        elif ".lora_" not in key:
            out[key.replace(".base_layer", "")] = value
    for name, wrapper in wrappers.items():
        key = f"{owners[name]}.{wrapper.parameter_name}"
        out[key] = out[key] + wrapper.get_delta_weight(ADAPTER).float().cpu()
    return out
