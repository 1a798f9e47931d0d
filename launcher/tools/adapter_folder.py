"""A run's adapters as a PEFT adapter folder: adapter_config.json + adapter_model.safetensors.

`peft.PeftModel.from_pretrained(base, folder)` loads the folder onto the base model the run adapted:
for `model.kind=hf` the transformers model itself (`AutoModelForCausalLM.from_pretrained(model.path)`,
or built from the run's config with its seed; key names are relative to it, as peft writes them),
for the built-in GPT our GPT module (`build_model(spec.model)` after `torch.manual_seed(train.seed)`). The adapters come from the run's checkpoint through the same
path as `train-merge` (launcher.tools.merge.load_adapted: the frozen base rebuilt from the spec, the
adapter-only state loaded into it). A quantized run's adapters were trained on an int8/nf4 base:
load them onto that base (transformers' BitsAndBytesConfig) to reproduce its outputs exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from launcher.components.adapters import adapter_layers, peft_config
from launcher.components.model.family import family_of
from launcher.components.model.hf_files import hf_config
from launcher.spec import RunSpec
from launcher.tools.merge import checkpoint_dir, load_adapted

if TYPE_CHECKING:
    from peft import LoraConfig


def _prefix(model: nn.Module) -> str | None:
    """Where the transformers model sits inside `model` (stripped from module names and keys); None: not one."""
    return family_of(model).transformers_prefix()


def _uses_conv1d(spec: RunSpec, layers: list[str]) -> bool:
    """Whether the transformers model stores the adapted layers as Conv1D (GPT-2), so peft needs fan_in_fan_out."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config(spec.model), trust_remote_code=False)
    return any(isinstance(hf.get_submodule(name), Conv1D) for name in layers)


def _adapter_config(spec: RunSpec, model: nn.Module, layers: list[str]) -> LoraConfig:
    """The peft LoraConfig for the base model the folder is loaded onto."""
    is_hf = _prefix(model) is not None
    config = peft_config(spec.quantization.lora, layers, fan_in_fan_out=is_hf and _uses_conv1d(spec, layers))
    if is_hf:
        config.task_type = "CAUSAL_LM"
        config.base_model_name_or_path = spec.model.path  # a pretrained folder; None for random weights
    return config


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights of an adapted model under the keys peft saves for its base model."""
    from peft import get_peft_model_state_dict

    prefix = _prefix(model) or ""
    state = get_peft_model_state_dict(model)
    return {
        "base_model.model." + key.removeprefix(prefix): value.detach().float().cpu().contiguous()
        for key, value in state.items()
    }


def write_adapter_folder(source: Path, out: Path) -> Path:
    """Write the adapters of `source` (a run directory or a step_N directory) as a PEFT folder `out`; returns `out`."""
    from safetensors.torch import save_file

    spec, model = load_adapted(checkpoint_dir(Path(source)))
    prefix = _prefix(model) or ""
    layers = [name.removeprefix(prefix) for name in adapter_layers(model)]
    if not layers:
        raise ValueError(f"{source} holds no adapters (quantization.lora.rank=0): nothing to write.")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _adapter_config(spec, model, layers).save_pretrained(str(out))
    save_file(adapter_tensors(model), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
