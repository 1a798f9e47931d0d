"""LoRA (and DoRA) adapters through peft: the `quantization.lora` schema, injection, adapter-only state.

Adapters are injected with `peft.inject_adapter_in_model`, not `get_peft_model`: the model object stays
ours (the built-in GPT, or HFCausalLM around a transformers model), so the loop still calls
`model(input_ids, position_ids=None) -> logits`, strategies, memory and compile see the same module
tree, and state-dict keys change only where a layer is adapted: `<layer>.weight` becomes
`<layer>.base_layer.weight`, next to `<layer>.lora_A.default.weight`, `<layer>.lora_B.default.weight`
(and DoRA's `<layer>.lora_magnitude_vector.default.weight`). A PeftModel wrapper would add a
`base_model.model.` prefix and its own forward signature for nothing we use.

peft picks its bitsandbytes LoRA layers (which dequantize for DoRA and merges) only when the model
says it was loaded in 8 or 4 bits (`is_loaded_in_8bit` / `is_loaded_in_4bit`, attributes transformers
sets); our quantized models are built by launcher.components.quantization, so `add_adapters` sets the flag
for the injection and checks that every quantized layer got peft's bitsandbytes wrapper.

A run with adapters checkpoints only what trains (`checkpoint_state`): the frozen base is rebuilt from
the spec at resume (same seed, same weights, same quantization), and `load_checkpoint_state` checks
that exactly the frozen keys are missing from what it loads.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

from rich.console import Console

from launcher.config.adapters import ADAPTER, QUANTIZED_FLAGS, LoRAConfig

if TYPE_CHECKING:  # torch only where a rank adds adapters: the launching process never needs it
    import torch
    from peft import LoraConfig
    from torch import nn


def matches(name: str, target: str) -> bool:
    """Whether the module `name` is `target` or ends with `.target` (peft's rule for target_modules)."""
    return name == target or name.endswith("." + target)


def chosen_layers(candidates: Iterable[str], targets: list[str] | None) -> list[str]:
    """The candidate layers `targets` name (null: all); a target that matches none is an error."""
    candidates = list(candidates)
    if targets is None:
        return candidates
    unmatched = [t for t in targets if not any(matches(name, t) for name in candidates)]
    if unmatched or not targets:
        leaves = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in candidates}))
        verb = "match" if len(unmatched) > 1 else "matches"
        raise ValueError(
            f"quantization.lora.targets: {', '.join(unmatched) or '[]'} {verb} none of this model's adaptable "
            f"linear layers ({leaves}); embeddings and the output head stay untargeted. Choose from that "
            "list, or use null for all."
        )
    return [name for name in candidates if any(matches(name, t) for t in targets)]


EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
"""Fused expert tensors of transformers' MoE layers [experts, out, in] that LoRA adapts per expert when targeted."""


def expert_parameters(model: nn.Module) -> list[str]:
    """Names of the fused expert parameters of `model` (peft adapts them through `target_parameters`)."""
    return [
        name
        for name, _ in model.named_parameters()
        if name.endswith(tuple("." + e for e in EXPERT_PARAMETERS))
    ]


def peft_config(
    cfg: LoRAConfig, layers: list[str], *, fan_in_fan_out: bool = False, parameters: list[str] | None = None
) -> LoraConfig:
    """The peft.LoraConfig of `cfg` for exactly the modules named in `layers` and the `parameters` (full names)."""
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=sorted(layers),
        target_parameters=sorted(parameters) if parameters else None,
        use_dora=cfg.dora,
        use_rslora=cfg.rslora,
        fan_in_fan_out=fan_in_fan_out,
        bias="none",
    )


def adapter_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers of `model` that hold a peft LoRA adapter, by module name."""
    if "peft" not in sys.modules:  # never imported: nothing holds an adapter (and peft stays optional)
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def add_adapters(
    model: nn.Module, cfg: LoRAConfig, candidates: list[str], *, quantized: str = "none"
) -> nn.Module:
    """Inject peft adapters into the targeted layers among `candidates` and freeze everything else.

    `quantized` is the quantization method the candidates were built with (none, int8, nf4): peft
    then wraps them in its bitsandbytes LoRA layers (checked here). Targets naming fused expert tensors
    (EXPERT_PARAMETERS, never quantized) adapt each expert's matrix with peft's `target_parameters`; a
    null target list adapts the linear layers only, as for dense models.
    """
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    experts = expert_parameters(model) if cfg.targets is not None else []
    chosen = chosen_layers([*candidates, *experts], cfg.targets)
    parameters = [name for name in chosen if name in set(experts)]
    layers = [name for name in chosen if name not in set(experts)]
    for param in model.parameters():
        param.requires_grad_(False)
    flag = QUANTIZED_FLAGS.get(quantized)
    if flag:
        setattr(model, flag, True)
    try:
        inject_adapter_in_model(peft_config(cfg, layers, parameters=parameters), model, adapter_name=ADAPTER)
    finally:
        if flag:
            delattr(model, flag)
    for name in layers:
        layer = model.get_submodule(name)
        if not isinstance(layer, LoraLayer):
            raise RuntimeError(f"peft did not adapt {name} ({type(layer).__name__}).")
        if flag and "bnb" not in type(layer).__module__:
            raise RuntimeError(
                f"peft wrapped the {quantized} layer {name} in {type(layer).__module__}.{type(layer).__name__}, "
                "not in its bitsandbytes LoRA layer: merges and DoRA would read the integer codes as weights."
            )
    for name in parameters:  # the experts module's outermost peft wrapper keeps its name
        if not isinstance(model.get_submodule(name.rsplit(".", 1)[0]), LoraLayer):
            raise RuntimeError(f"peft did not adapt the expert tensor {name}.")
    _report(model, cfg, len(layers) + len(parameters))
    return model


def _report(model: nn.Module, cfg: LoRAConfig, num_layers: int) -> None:
    """One line on rank 0: how many parameters train."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    kind = "DoRA" if cfg.dora else "LoRA"
    Console().print(
        f"{kind} (peft): rank {cfg.rank}{' rsLoRA' if cfg.rslora else ''} on {num_layers} layers; "
        f"{trainable:,} trainable of {total:,} stored parameters ({100 * trainable / total:.2f}%), "
        "everything else frozen",
        soft_wrap=True,
    )


def folded_weight(layer: nn.Module, base_weight: torch.Tensor) -> torch.Tensor:
    """The float32 weight of an adapted layer with its adapter folded in, given its base weight.

    LoRA: W + scale * B @ A (peft's get_delta_weight, rsLoRA's scale included). DoRA: the same
    direction rescaled to the trained magnitude per output row, m * (W + dW) / ||W + dW||.
    """
    import torch

    with torch.no_grad():
        weight = base_weight.float()
        delta = layer.get_delta_weight(ADAPTER).float().to(weight.device)
        if not layer.use_dora.get(ADAPTER, False):
            return weight + delta
        magnitude = layer.lora_magnitude_vector[ADAPTER]
        norm = magnitude.get_weight_norm(weight, delta, scaling=1).float()
        return (magnitude.weight.float() / norm).view(-1, 1) * (weight + delta)


def has_adapters(model: nn.Module) -> bool:
    """Whether `model` holds peft LoRA adapters."""
    return bool(adapter_layers(model))


def frozen_keys(model: nn.Module) -> set[str]:
    """State-dict keys of `model` that an adapter checkpoint leaves out: all but the trainable parameters."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return set(model.state_dict()) - trainable


def checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of `model`: with adapters, only the trainable parameters; else everything."""
    state = model.state_dict()
    if not has_adapters(model):
        return state
    frozen = frozen_keys(model)
    return {k: v for k, v in state.items() if k not in frozen}


def check_loaded_keys(model: nn.Module, keys: Iterable[str]) -> None:
    """Raise unless `keys` are exactly the trainable keys of the adapted `model` (all frozen ones missing)."""
    keys = set(keys)
    expected = set(model.state_dict()) - frozen_keys(model)
    missing, unexpected = sorted(expected - keys), sorted(keys - expected)
    if not (missing or unexpected):
        return
    problems = [
        f"missing {_some(missing)}" if missing else "",
        f"unexpected {_some(unexpected)}" if unexpected else "",
    ]
    raise KeyError(
        f"the adapter checkpoint does not fit this model ({'; '.join(p for p in problems if p)}): was it "
        "written by a run with another model, quantization or quantization.lora settings?"
    )


def _some(keys: list[str]) -> str:
    """Up to three keys and how many more."""
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return ", ".join(keys[:3]) + more


def load_checkpoint_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load what `checkpoint_state` wrote: strictly without adapters; with them, exactly the trainable keys."""
    if not has_adapters(model):
        model.load_state_dict(state)
        return
    check_loaded_keys(model, state)
    model.load_state_dict(state, strict=False)
