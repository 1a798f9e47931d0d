"""Strategies are peers in a plain registry of capabilities, each module imported only when chosen (DeepSpeed is heavy).

parallel.strategy names the data-parallel method (single, ddp, fsdp, deepspeed) or tensor parallel
alone (tp); pipeline parallel is an axis (parallel.pp_size) that composes with single, ddp and fsdp.
`pp` stays an alias: fsdp inside pipeline stages, plain stages where one rank holds a stage. Code
outside launcher.rules asks an entry's capabilities, never a strategy's name. Each entry's wrap is its
data-parallel method's (launcher.config.parallel.METHODS, which the planner and the builders ask too).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from launcher.config.parallel import method_of

if TYPE_CHECKING:
    from torch import nn

    from launcher.parallel.strategy import Setup, Strategy, StrategyModule

PARTS = "launcher.parallel.parts"
"""The one Strategy implementation over model parts, parameterised by the data-parallel wrap."""


@dataclass(frozen=True, kw_only=True)
class StrategyEntry:
    """One strategy: where it lives, what the build prepares for it and how each model part is wrapped."""

    module: str
    """Module offering `build(parts, setup)` and `consolidate(directory)` (the StrategyModule protocol)."""
    process_group: bool
    """Needs a process group even when the job has one rank (DDP, DeepSpeed and the DTensor strategies)."""
    device_mesh: bool
    """Shards with DTensors over the run's device mesh (checkpoints are DCP shards)."""
    wrap: str
    """The data-parallel wrap launcher.parallel.parallelize applies last to each part: none, ddp, fsdp, or
    engine (DeepSpeed wraps the model in its own engine when the strategy is built)."""
    wrap_one_rank: bool = True
    """Wrap even where one rank holds each part (False: the pp alias runs plain stages without data parallelism)."""
    fsdp_teacher: bool = False
    """A distillation teacher is sharded with FSDP2 like the student (else a whole copy per rank)."""


def _wrap(name: str) -> str:
    return method_of(name).wrap


STRATEGIES: dict[str, StrategyEntry] = {
    "single": StrategyEntry(module=PARTS, process_group=False, device_mesh=False, wrap=_wrap("single")),
    "ddp": StrategyEntry(module=PARTS, process_group=True, device_mesh=False, wrap=_wrap("ddp")),
    "deepspeed": StrategyEntry(
        module="launcher.parallel.deepspeed", process_group=True, device_mesh=False, wrap=_wrap("deepspeed")
    ),
    "fsdp": StrategyEntry(
        module=PARTS, process_group=True, device_mesh=True, wrap=_wrap("fsdp"), fsdp_teacher=True
    ),
    "tp": StrategyEntry(module=PARTS, process_group=True, device_mesh=True, wrap=_wrap("tp")),
    "pp": StrategyEntry(
        module=PARTS, process_group=True, device_mesh=True, wrap=_wrap("pp"), wrap_one_rank=False
    ),
}
"""Every option of parallel.strategy."""


def strategy_module(name: str) -> StrategyModule:
    """The module of strategy `name`, imported on demand."""
    return cast("StrategyModule", importlib.import_module(STRATEGIES[name].module))


def build_strategy(parts: list[nn.Module], setup: Setup) -> Strategy:
    """The loop's strategy over this rank's model parts (already parallelized), as the spec names it."""
    return strategy_module(setup.spec.parallel.strategy).build(parts, setup)
