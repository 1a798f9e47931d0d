"""Schema of the compile group: torch.compile of the model, per transformer block.

What the group builds at run time lives in launcher.components.compile.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("off", "default", "reduce-overhead", "max-autotune")


@dataclass(frozen=True, kw_only=True)
class CompileConfig:
    """Whether and how torch.compile compiles the model."""

    mode: str = "off"
    """off (eager), default, reduce-overhead (CUDA graphs, CUDA only) or max-autotune (autotuned kernels)."""
    fullgraph: bool = False
    """Refuse graph breaks: compiling fails instead of falling back to Python for unsupported code."""
    dynamic: bool | None = None
    """Compile for dynamic shapes: true from the start, false never, null after a shape changes (torch's default)."""
