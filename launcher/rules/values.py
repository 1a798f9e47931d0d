"""What every rule is, and the checks the rule modules share (a name among choices, a positive number, a package).

"Installed" is asked of importlib's finder, not answered by importing: the launching process
stays light (mlflow or deepspeed alone take seconds to import), and the ranks import what they use.
"""

from __future__ import annotations

import importlib.util
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


def installed(module: str) -> bool:
    """Whether `module` can be imported here, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a blocked or broken entry in sys.modules
        return False


def missing(module: str, keys: tuple[str, ...], message: str) -> Iterator[SpecError]:
    """The error `message` on `keys` when an optional package's `module` is not installed."""
    if not installed(module):
        yield SpecError(keys, message)
