"""What every rule is, and the value checks the rule modules share (a name among choices, a positive number)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from launcher.spec import RunSpec, SpecError, did_you_mean

if TYPE_CHECKING:
    from launcher.rules.hardware import Hardware

Rule = Callable[[RunSpec, "Hardware"], Iterator[SpecError]]
"""A cross-field rule: yields one SpecError per violation it finds in a spec (nothing when it holds)."""


def choice(key: str, value: str, choices: Iterable[str], what: str) -> Iterator[SpecError]:
    """An error naming the options when `value` is not one of `choices`."""
    options = list(choices)
    if value not in options:
        yield SpecError(
            (key,),
            f"unknown {what} '{value}'.{did_you_mean(value, options)} Choose one of: {', '.join(options)}.",
        )


def positive(key: str, value: float | None, fix: str = "") -> Iterator[SpecError]:
    """An error when a number that must be positive is not (None passes: it means "off")."""
    if value is not None and value <= 0:
        yield SpecError((key,), f"must be positive, got {value}.{(' ' + fix) if fix else ''}")
