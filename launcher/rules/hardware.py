"""What the machine that will run the ranks can do: the facts the hardware rules judge a spec against."""

from __future__ import annotations

from dataclasses import dataclass

from launcher.components.hardware_facts import NO_CUDA, cuda_facts
from launcher.config.precision import FP8_MIN_CAPABILITY
from launcher.plan.roofline import HARDWARE
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
    """CUDA devices per node: visible to this process (0 for a spec on the CPU), or (a SLURM job) requested per node."""
    requested: bool = False
    """The facts describe a machine the spec names, not this one: a SLURM job's requested nodes, or the GPU
    (simulate_hardware) a dry run plans for where this machine has none; nothing starts here."""
    gpu_memory_bytes: int = 0
    """Memory of one GPU (the smallest visible); 0 where unknown (no GPU, or a SLURM job's nodes)."""
    fp8: bool = False
    """float8 matmuls exist there (CUDA compute capability 8.9+)."""
    capability: tuple[int, int] = (0, 0)
    """Compute capability of the first GPU; (0, 0) on a CPU or where unknown (a SLURM job's nodes)."""
    gpu_name: str = ""
    """What the GPU is called (the probed device's name, or the named profile's); empty on a CPU or where unknown."""

    @property
    def missing_gpu(self) -> bool:
        """The run asks for CUDA on this machine and no GPU is here: rules/launch.py refuses it, no other rule judges
        the absent device's capabilities."""
        return self.device_type == "cuda" and self.num_gpus == 0 and not self.requested


def detect_hardware(spec: RunSpec) -> Hardware:
    """Probe the device the spec would run on; for a SLURM job, judge the nodes it asks for instead.

    A spec on the CPU asks nothing about CUDA; otherwise the facts come from one cached probe
    (launcher.components.hardware_facts), so judging a spec does not import torch.
    """
    if spec.launcher.backend == "slurm":
        return requested_hardware(spec)
    requested = spec.launcher.device
    facts = NO_CUDA if requested == "cpu" else cuda_facts()
    if requested == "cuda" and not facts.available and spec.dry_run and spec.simulate_hardware in HARDWARE:
        return named_gpu(spec)  # a dry run starts nothing here: plan for the GPU the spec names
    kind = ("cuda" if facts.available else "cpu") if requested == "auto" else requested
    return Hardware(
        device_type=kind,
        bf16=kind == "cpu" or facts.bf16,
        tf32=kind == "cuda" and facts.capability[0] >= 8,
        num_gpus=facts.num_gpus,
        gpu_memory_bytes=facts.gpu_memory_bytes if kind == "cuda" else 0,
        fp8=kind == "cuda" and tuple(facts.capability) >= FP8_MIN_CAPABILITY,
        capability=tuple(facts.capability) if kind == "cuda" else (0, 0),
        gpu_name=facts.gpu_name if kind == "cuda" else "",
    )


def named_gpu(spec: RunSpec) -> Hardware:
    """The GPU `simulate_hardware` names (launcher.plan.roofline.HARDWARE), launcher.nproc of them: what a dry run
    on a machine without one judges the spec against; the real run's rules probe its own machine."""
    profile = HARDWARE[spec.simulate_hardware]
    return Hardware(
        device_type="cuda",
        bf16=profile.capability >= (8, 0),
        tf32=profile.capability >= (8, 0),
        num_gpus=spec.launcher.nproc,
        requested=True,
        gpu_memory_bytes=profile.memory_bytes,
        fp8=profile.capability >= FP8_MIN_CAPABILITY,
        capability=profile.capability,
        gpu_name=f"{profile.name} (simulate_hardware={spec.simulate_hardware})",
    )


def requested_hardware(spec: RunSpec) -> Hardware:
    """The nodes a SLURM job asks for: a login node often has no GPU, so probing it would judge the wrong machine.

    GPU nodes are taken to support bf16, TF32 (Ampere or newer) and fp8; the rank checks the real device at start.
    """
    gpus = spec.launcher.slurm.gpus_per_node
    cuda = spec.launcher.device == "cuda" or (spec.launcher.device == "auto" and gpus > 0)
    return Hardware(
        device_type="cuda" if cuda else "cpu",
        bf16=True,
        tf32=cuda,
        fp8=cuda,
        num_gpus=max(gpus, 0),
        requested=True,
    )
