"""Where a simulated run goes: nowhere real. One process plays a rank of each role on a fake process group
(launcher.rank.simulate), as the inline backend plays the one rank of a run in this process."""

from __future__ import annotations

from launcher.rank.simulate import RoleResult, SimulationRefused, simulate
from launcher.spec import RunSpec

__all__ = ["RoleResult", "SimulationRefused", "run"]


def run(spec: RunSpec) -> list[RoleResult]:
    """Every role's measured step on a fake process group of the spec's world size (SimulationRefused: no build)."""
    return simulate(spec)
