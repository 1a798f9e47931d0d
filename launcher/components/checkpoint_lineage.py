"""A run's checkpoints as a line of descent: `latest` names the head, each COMPLETE manifest its parent.

A session that resumes from an earlier checkpoint than the newest (resume=checkpoints/step_10 while
step_20 exists) starts a branch: its first checkpoint records step_10 as its parent, and `latest`
names it. `resume=auto` follows `latest` and the recorded parents, never the highest step number, so
the steps of the branch are not dropped for the abandoned step_20 (launcher.components.checkpoint_aside
moves such checkpoints to checkpoints/abandoned/). Manifests written before parents were recorded
(no `parent` key) fall back to the older rule: every lower step is an ancestor. Only paths are read
here (the COMPLETE manifests); nothing is moved.
"""

from __future__ import annotations

from pathlib import Path

from launcher.components.checkpoint_files import read_manifest
from launcher.config.checkpoint import LATEST

PARENT = "parent"
"""The manifest key naming the step directory (of the same run) a checkpoint continues from; null: a fresh start."""
_UNKNOWN = object()
"""A manifest that records no parent (written before parents were recorded, or unreadable)."""


def _step(path: Path) -> int:
    return int(path.name.split("_")[-1])


def parent_of(path: Path) -> object:
    """The name of the step directory `path` continues from, None for a fresh start, _UNKNOWN when not recorded."""
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return _UNKNOWN
    if PARENT not in manifest:
        return _UNKNOWN
    parent = manifest[PARENT]
    return parent if isinstance(parent, str) and parent.startswith("step_") else None


def head(base: Path, dirs: list[Path]) -> Path | None:
    """The checkpoint `latest` names (when it is one of `dirs`), else the highest step of `dirs` (newest first)."""
    pointer = base / LATEST
    try:
        named = pointer.read_text().strip() if pointer.is_file() else ""
    except (OSError, UnicodeDecodeError):
        named = ""
    found = next((p for p in dirs if p.name == named), None)
    return found or (dirs[0] if dirs else None)


def descent(start: Path, dirs: list[Path]) -> list[Path]:
    """`start` and its ancestors among `dirs` (step directories, newest first), newest first.

    A parent that is no longer there (pruned, set aside) ends the line; a manifest that records no
    parent continues with every lower step (the rule before parents were recorded).
    """
    by_name = {p.name: p for p in dirs}
    line: list[Path] = []
    current: Path | None = start
    while current is not None and current not in line:
        line.append(current)
        parent = parent_of(current)
        if parent is _UNKNOWN:
            line += [p for p in dirs if _step(p) < _step(current) and p not in line]
            break
        current = by_name.get(parent) if isinstance(parent, str) else None
    return line


def lineage(base: Path, dirs: list[Path]) -> list[Path]:
    """The checkpoints `resume=auto` may continue from, newest first: the head (`latest`) and its ancestors."""
    start = head(base, dirs)
    return descent(start, dirs) if start is not None else []
