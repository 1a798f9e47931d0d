"""Warnings on the console as one line each, `warning: MESSAGE`, each text once per process.

Python's display prints `PATH:LINE: UserWarning: MESSAGE` and then the source line, which says
nothing to a person running `train`; and the launching process and an inline rank run the same
checks (the resume candidates, say), so one problem was shown twice. The launcher's own warnings
(raised from inside this package) print as one line, once; other libraries' warnings keep Python's
format, where the category and the location help.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, TextIO

PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep
_python_display = warnings.showwarning
_shown: set[str] = set()


def show(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """`warnings.showwarning` for this process: the launcher's warnings as `warning: MESSAGE`, once each."""
    if not str(Path(filename).resolve()).startswith(PACKAGE):
        _python_display(message, category, filename, lineno, file, line)
        return
    text = str(message).strip()
    if text in _shown:
        return
    _shown.add(text)
    stream: Any = file if file is not None else sys.stderr
    try:
        stream.write(f"warning: {text}\n")
        stream.flush()
    except (OSError, ValueError):  # a closed or gone stream: nothing to tell
        pass


def install() -> None:
    """Show warnings through `show` in this process (idempotent)."""
    warnings.showwarning = show
