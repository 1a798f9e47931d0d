"""Rules of the profiler settings: non-negative schedule steps, and a run long enough for one cycle."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError


def _profile(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p = spec.profiler
    for key, value, least in (("wait", p.wait, 0), ("warmup", p.warmup, 0), ("active", p.active, 1),
                              ("repeat", p.repeat, 0), ("top_ops", p.top_ops, 1)):  # fmt: skip
        if value < least:
            yield SpecError((f"profiler.{key}",), f"must be {least} or more, got {value}.")
    if spec.profile and spec.train.max_steps < p.steps_needed():
        yield SpecError(
            ("profile", "profiler.wait", "profiler.warmup", "profiler.active", "train.max_steps"),
            f"the profiler records after wait + warmup + active = {p.steps_needed()} steps, but the run has "
            f"{spec.train.max_steps}. Raise train.max_steps or lower the profiler's steps.",
        )


RULES: tuple[Rule, ...] = (_profile,)
"""This module's rules, in the order they report."""
