"""`recipe=auto`: pick a recipe from the detected hardware and the memory planner, and say why.

The parsed command line is rewritten before Hydra composes it: `recipe=auto` becomes the chosen recipe
(plus `launcher.nproc=<GPUs>` for the multi-GPU recipes unless the command line sets it). The
choice is a pure function of a machine description and a per-recipe memory estimate, so it can be
checked for any machine without one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console

from launcher.front.command_line import CommandLine
from launcher.plan.render import format_bytes

AUTO = "auto"
CPU_RECIPE = "cpu"
# A plan must fit in this share of a GPU's memory (the rest absorbs what the planner misses).
HEADROOM = 0.9
# Per-rank recipes in order of preference: the fastest first, the most memory-frugal last.
SINGLE_GPU = ("large_gpu", "small_gpu", "huge_model_zero3_offload")
FEW_GPUS = ("multi_gpu_ddp", "multi_gpu_fsdp", "huge_model_zero3_offload")
MANY_GPUS = ("multi_gpu_fsdp", "huge_model_zero3_offload")
MAX_DDP_GPUS = 4
MULTI_RANK = ("multi_gpu_ddp", "multi_gpu_fsdp", "huge_model_zero3_offload")

Estimate = Callable[[str, int], int]
"""(recipe, GPUs) -> planned bytes per GPU of the run with that recipe."""


@dataclass(frozen=True, kw_only=True)
class Machine:
    """The GPUs a run could use."""

    num_gpus: int
    """CUDA devices visible to this process."""
    gpu_memory_bytes: int = 0
    """Memory of the smallest visible GPU."""
    gpu_name: str = ""
    """Name of the first GPU, for the message."""


@dataclass(frozen=True, kw_only=True)
class Choice:
    """The recipe `recipe=auto` stands for, and why."""

    recipe: str
    """Name of a file in recipes/."""
    reason: str
    """One sentence for the user."""
    nproc: int = 1
    """Ranks the recipe should run (the GPU count for multi-GPU recipes)."""


def detect_machine() -> Machine:
    """The CUDA GPUs torch sees (none on a CPU-only build or machine), from the cached probe."""
    from launcher.components.hardware_facts import cuda_facts

    facts = cuda_facts()
    if not facts.available:
        return Machine(num_gpus=0)
    return Machine(num_gpus=facts.num_gpus, gpu_memory_bytes=facts.gpu_memory_bytes, gpu_name=facts.gpu_name)


def candidates(machine: Machine) -> tuple[str, ...]:
    """Recipes worth considering on `machine`, preferred first."""
    if machine.num_gpus == 0:
        return (CPU_RECIPE,)
    if machine.num_gpus == 1:
        return SINGLE_GPU
    return FEW_GPUS if machine.num_gpus <= MAX_DDP_GPUS else MANY_GPUS


def choose(machine: Machine, estimate: Estimate) -> Choice:
    """The first recipe whose planned memory per GPU fits in HEADROOM of the GPU, else the most frugal."""
    if machine.num_gpus == 0:
        return Choice(recipe=CPU_RECIPE, reason="no CUDA GPU is visible, so the run goes to the CPU.")
    budget = HEADROOM * machine.gpu_memory_bytes
    gpus = f"{machine.num_gpus} x {machine.gpu_name or 'GPU'} ({format_bytes(machine.gpu_memory_bytes)} each)"
    tried: list[tuple[str, int]] = []
    for name in candidates(machine):
        ranks = machine.num_gpus if name in MULTI_RANK else 1
        need = estimate(name, ranks)
        if need <= budget:
            skipped = f" ({'; '.join(_said(t) for t in tried)} did not fit)" if tried else ""
            return Choice(
                recipe=name,
                reason=f"{gpus}: {name} plans {format_bytes(need)} per GPU, within {HEADROOM:.0%} of "
                f"its memory{skipped}.",
                nproc=ranks,
            )
        tried.append((name, need))
    name = min(tried, key=lambda t: t[1])[0]
    return Choice(
        recipe=name,
        reason=f"{gpus}: no recipe fits in {HEADROOM:.0%} of a GPU ({'; '.join(_said(t) for t in tried)}); "
        f"{name} needs the least, so it is used. Consider a smaller model, micro batch or sequence length.",
        nproc=machine.num_gpus if name in MULTI_RANK else 1,
    )


def _said(tried: tuple[str, int]) -> str:
    return f"{tried[0]} plans {format_bytes(tried[1])}"


def planned_bytes(overrides: list[str]) -> Estimate:
    """An Estimate that composes the user's overrides with each recipe and plans it for CUDA."""
    from launcher.front import compose
    from launcher.plan import planner
    from launcher.spec import to_spec

    def estimate(recipe: str, ranks: int) -> int:
        extra = [f"launcher.nproc={ranks}"] if recipe in MULTI_RANK and not _sets_nproc(overrides) else []
        cfg = compose.compose([*overrides, f"recipe={recipe}", *extra])
        return planner.plan(to_spec(compose.strip_hydra(cfg)), device_type="cuda").total

    return estimate


def _sets_nproc(overrides: list[str]) -> bool:
    return any(o.lstrip("+").startswith("launcher.nproc=") for o in overrides)


def resolve(line: CommandLine, machine: Machine | None = None, console: Console | None = None) -> CommandLine:
    """The command line with `recipe=auto` replaced by the chosen recipe, printing why."""
    if f"recipe={AUTO}" not in line.overrides:
        return line
    overrides = [o for o in line.overrides if o != f"recipe={AUTO}"]
    machine = machine or detect_machine()
    choice = choose(machine, planned_bytes(overrides))
    (console or Console(stderr=True, highlight=False)).print(
        f"recipe=auto -> recipe={choice.recipe}: {choice.reason}"
    )
    extra = (
        [f"launcher.nproc={choice.nproc}"]
        if choice.recipe in MULTI_RANK and not _sets_nproc(overrides)
        else []
    )
    return line.with_overrides([*overrides, f"recipe={choice.recipe}", *extra])
