"""`no_grad` for the offline commands, importing torch only when the function runs.

`train-export`, `train-generate`, `train-quantize` and `train-merge` answer `--help` and argument
errors before torch is imported (seconds on a busy machine); `@torch.no_grad()` at a module's top
level would import it with the module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def no_grad(fn: F) -> F:
    """`fn` run under torch.no_grad(), with torch imported at the first call."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
