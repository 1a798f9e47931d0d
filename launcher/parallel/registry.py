"""Strategies are peers in a plain registry, each module imported only when chosen (DeepSpeed is heavy)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from torch import nn

    from launcher.parallel.strategy import Setup, Strategy, StrategyModule


@dataclass(frozen=True, kw_only=True)
class StrategyEntry:
    """One strategy: where it lives and what the build must prepare for it."""

    module: str
    """Module offering `build(model, setup)` and `consolidate(directory)` (the StrategyModule protocol)."""
    process_group: bool
    """Needs a process group even when the job has one rank (DDP, DeepSpeed and the DTensor strategies)."""
    device_mesh: bool
    """Shards with DTensors over the run's device mesh, which the topology owner builds once."""


STRATEGIES: dict[str, StrategyEntry] = {
    "single": StrategyEntry(module="launcher.parallel.single", process_group=False, device_mesh=False),
    "ddp": StrategyEntry(module="launcher.parallel.ddp", process_group=True, device_mesh=False),
    "deepspeed": StrategyEntry(module="launcher.parallel.deepspeed", process_group=True, device_mesh=False),
    "fsdp": StrategyEntry(module="launcher.parallel.fsdp", process_group=True, device_mesh=True),
    "tp": StrategyEntry(module="launcher.parallel.tensor_parallel", process_group=True, device_mesh=True),
    "pp": StrategyEntry(module="launcher.parallel.pipeline", process_group=True, device_mesh=True),
}
"""Every option of parallel.strategy."""


def strategy_module(name: str) -> StrategyModule:
    """The module of strategy `name`, imported on demand."""
    return cast("StrategyModule", importlib.import_module(STRATEGIES[name].module))


def build_strategy(model: nn.Module, setup: Setup) -> Strategy:
    """Wrap `model` with the strategy the spec names."""
    return strategy_module(setup.spec.parallel.strategy).build(model, setup)
