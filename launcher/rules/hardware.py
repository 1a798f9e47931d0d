"""What the machine that will run the ranks can do: the facts the hardware rules judge a spec against."""

from __future__ import annotations

from dataclasses import dataclass

from launcher.groups import device
from launcher.spec import RunSpec


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """What the machine that will run the ranks can do."""

    device_type: str
    """cpu or cuda: the device the ranks compute on."""
    bf16: bool
    """bf16 autocast works there."""
    tf32: bool
    """TF32 matmuls exist there."""
    num_gpus: int
    """CUDA devices visible to this process."""


def detect_hardware(spec: RunSpec) -> Hardware:
    """Probe the device the spec would run on."""
    kind = device.resolve_device(spec.launcher.device)
    return Hardware(
        device_type=kind,
        bf16=device.bf16_supported(kind),
        tf32=device.tf32_supported(kind),
        num_gpus=device.num_gpus(),
    )
