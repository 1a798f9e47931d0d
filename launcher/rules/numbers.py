"""Every number of the spec is a real, representable one: floats finite, integers within 64 bits.

YAML and the command line accept `inf`, `nan` and `1e400` (which is inf) as floats and integers of
any size; none of them means anything for a hyper-parameter here, and an infinite learning rate
would write non-finite weights. A key that accepts a non-finite value would be listed in
FINITE_EXEMPT with the reason; none does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError

INT64_MAX = 2**63 - 1
FINITE_EXEMPT: frozenset[str] = frozenset()


def _numbers(node: Any, prefix: str = "") -> Iterator[tuple[str, float | int]]:
    """(dotted key, value) of every number in a spec dataclass, lists included."""
    if dataclasses.is_dataclass(node):
        for item in dataclasses.fields(node):
            yield from _numbers(getattr(node, item.name), f"{prefix}{item.name}.")
    elif isinstance(node, list | tuple):
        for i, value in enumerate(node):
            yield from _numbers(value, f"{prefix[:-1]}[{i}].")
    elif isinstance(node, int | float) and not isinstance(node, bool):
        yield prefix[:-1], node


def _finite(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    for key, value in _numbers(spec):
        if isinstance(value, float) and not math.isfinite(value) and key not in FINITE_EXEMPT:
            yield SpecError(
                (key,),
                f"must be a finite number, got {value} (`1e400` and larger read as inf). Give a real value"
                + (", e.g. optimizer.lr=3e-4." if key == "optimizer.lr" else "."),
            )
        elif isinstance(value, int) and abs(value) > INT64_MAX:
            yield SpecError(
                (key,),
                f"{value} does not fit in 64 bits (at most {INT64_MAX:,}); give a realistic value.",
            )


RULES: tuple[Rule, ...] = (_finite,)
"""This module's rules, in the order they report."""
