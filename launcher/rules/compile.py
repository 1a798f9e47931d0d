"""Rules of the compile group: a known mode, tuning flags only when compiling, CUDA graphs only on CUDA."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.config.compile import MODES
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, choice
from launcher.spec import RunSpec, SpecError


def _compile(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    c = spec.compile
    yield from choice("compile.mode", c.mode, MODES, "compile mode")
    if c.mode == "off" and (c.fullgraph or c.dynamic is not None):
        yield SpecError(
            ("compile.mode", "compile.fullgraph", "compile.dynamic"),
            "fullgraph and dynamic tune torch.compile, which is off. Pick a mode (e.g. `compile=default`) or "
            "drop them.",
        )
    if c.mode == "reduce-overhead" and hw.device_type != "cuda":
        yield SpecError(
            ("compile.mode",),
            f"reduce-overhead captures CUDA graphs, which do not exist on {hw.device_type}. Use `compile=default`.",
        )


RULES: tuple[Rule, ...] = (_compile,)
"""This module's rules, in the order they report."""
