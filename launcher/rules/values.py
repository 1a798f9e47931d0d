"""What every rule is, and the checks the rule modules share (a name among choices, a positive number, a package,
the domain a key's values lie in).

"Installed" is asked of importlib's finder, not answered by importing: the launching process
stays light (mlflow or deepspeed alone take seconds to import), and the ranks import what they use.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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


@dataclass(frozen=True, kw_only=True)
class Domain:
    """What one key accepts: one of `choices`, a number within [low, high] (ends open where said), a bool, or text."""

    kind: str
    """choice, number, flag or text."""
    choices: tuple[str, ...] = ()
    """choice: the options."""
    low: float | None = None
    """number: the least value (None: no bound)."""
    high: float | None = None
    """number: the greatest value (None: no bound)."""
    low_open: bool = False
    """number: `low` itself is refused."""
    high_open: bool = False
    """number: `high` itself is refused."""
    size: int | None = None
    """A list of numbers: how many it holds (None: any)."""
    why: str = ""
    """text: why any string is taken (a path, a name), or which rule judges its form; number: the fix."""

    def describe(self) -> str:
        """The range in words: `at least 1`, `above 0`, `in [0, 1)`."""
        if self.high is None and self.low_open:
            return "positive" if self.low == 0 else f"above {_num(self.low)}"
        if self.high is None:
            return f"at least {_num(self.low)}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{_num(self.low)}, {_num(self.high)}{right}"

    def holds(self, value: float) -> bool:
        """Whether a number lies in the range (non-finite numbers never do)."""
        if not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or not (value > self.high or (self.high_open and value == self.high))


def _num(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


FLAG = Domain(kind="flag")


def one_of(options: Any) -> Domain:
    """A name among `options`."""
    return Domain(kind="choice", choices=tuple(options))


def at_least(low: float, why: str = "", size: int | None = None) -> Domain:
    """A number no smaller than `low`."""
    return Domain(kind="number", low=low, why=why, size=size)


def above(low: float, why: str = "") -> Domain:
    """A number larger than `low`."""
    return Domain(kind="number", low=low, low_open=True, why=why)


def within(
    low: float, high: float, *, high_open: bool = False, low_open: bool = False, size: int | None = None
) -> Domain:
    """A number between `low` and `high`."""
    return Domain(kind="number", low=low, high=high, low_open=low_open, high_open=high_open, size=size)


def text(why: str) -> Domain:
    """Any string (or null where the schema allows): `why` says what it names, or which rule reads its form."""
    return Domain(kind="text", why=why)
