"""Which device a run computes on, its name, and its dense peak FLOP/s for MFU.

`resolve_device` serves the launching process too: until torch is imported it asks
launcher.components.hardware_facts, where the rules also read bf16, TF32, GPU count and memory.
"""

from __future__ import annotations

import sys

from launcher.components.hardware_facts import cuda_facts

# Dense (no sparsity) bf16/fp16 tensor-core peak FLOP/s by device name fragment, from the vendors'
# data sheets. The first matching fragment wins, so more specific names come first.
PEAK_FLOPS_BF16: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A10G", 125e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),
    ("T4", 65e12),
)


def resolve_device(requested: str) -> str:
    """Turn `auto` into `cuda` when a GPU is visible, else `cpu`; pass explicit choices through."""
    if requested == "auto":
        return "cuda" if cuda_available() else "cpu"
    return requested


def cuda_available() -> bool:
    """Whether a CUDA device can be used by this process (before torch is imported: launcher.components.hardware_facts)."""
    if "torch" not in sys.modules:
        return cuda_facts().available
    import torch

    return torch.cuda.is_available()


def device_name(device_type: str) -> str:
    """A human-readable name of the device that runs the model."""
    import torch

    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def peak_flops(device_type: str) -> float | None:
    """The device's dense bf16 peak FLOP/s, or None where it is not known (every CPU)."""
    import torch

    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for fragment, flops in PEAK_FLOPS_BF16:
        if fragment in name:
            return flops
    return None
