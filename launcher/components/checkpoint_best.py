"""The best checkpoint of `checkpoint.keep_best`: named by checkpoints/best and by each manifest's `best` key.

Every checkpoint's COMPLETE manifest records `best`, the step directory holding the best value of the
metric along its line of descent at the time it was sealed (itself, when its own evaluation was the
best so far), and `scores`, the values measured at its step. The commit points checkpoints/best at
the newest manifest's `best`; pruning keeps it whatever `checkpoint.keep` says; a resume onto an
earlier branch points it at the resumed checkpoint's `best` (launcher.components.checkpoint_aside).
Only paths and manifests are read here; nothing is moved or removed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from launcher.components.checkpoint_files import read_manifest
from launcher.config.checkpoint import BEST

KEY = "best"
"""The manifest key naming the best checkpoint of its line (a `step_N` directory of the same run), or null."""


def recorded(step_dir: Path) -> str | None:
    """The best checkpoint `step_dir`'s manifest names (None: none recorded, or the manifest does not read)."""
    try:
        name = read_manifest(step_dir).get(KEY)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return name if isinstance(name, str) and name.startswith("step_") and name[5:].isdigit() else None


def named(base: Path) -> Path | None:
    """The step directory checkpoints/best names when it is there, else None (`base`: the checkpoints folder)."""
    try:
        name = (base / BEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    path = base / name
    return path if name.startswith("step_") and path.is_dir() else None


def point(base: Path, name: str | None) -> None:
    """Make checkpoints/best name `name` (atomically; None removes the pointer)."""
    pointer = base / BEST
    if name is None:
        pointer.unlink(missing_ok=True)
        return
    staged = base / f"{BEST}.tmp"
    with open(staged, "w") as handle:
        handle.write(name + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staged, pointer)


def after_commit(base: Path, info: dict[str, Any]) -> None:
    """Rank 0, once a checkpoint is sealed: point checkpoints/best at the best its manifest (`info`) records."""
    if info.get(KEY):
        point(base, info[KEY])
