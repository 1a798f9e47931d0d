"""Atomic, verifiable checkpoints: write to a partial directory, mark complete last, rename, prune.

A checkpoint counts only once its COMPLETE marker (a manifest of every file and its size) is written,
after all files, and its directory is renamed from `.partial_step_N` to `step_N`. Resume scans the
step directories newest first and skips any whose marker is missing or whose files do not match it.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MARKER = "COMPLETE"
LATEST = "latest"
PARTIAL_PREFIX = ".partial_"


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When checkpoints are written and how many are kept."""

    every: int | None = 100
    """Optimizer steps between checkpoints; null turns periodic checkpoints off."""
    keep: int = 2
    """Newest complete checkpoints kept on disk (the newest good one is never deleted)."""
    save_final: bool = True
    """Also checkpoint after the last step, so a finished run can be extended or exported."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the previous complete one is untouched."""


def root(run_dir: Path) -> Path:
    """The directory holding a run's checkpoints."""
    return Path(run_dir) / "checkpoints"


def step_of(path: Path) -> int:
    """The optimizer step a `step_N` directory was written at."""
    return int(path.name.split("_")[-1])


def _fsync_write(path: Path, text: str) -> None:
    """Write `text` to `path` and flush it to disk before returning."""
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _manifest(directory: Path) -> dict[str, int]:
    """Every file under `directory` (relative path) with its size in bytes."""
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


def problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted, or None if it is complete."""
    marker = path / MARKER
    if not marker.is_file():
        return "no COMPLETE marker (the save did not finish)"
    try:
        expected = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError) as err:
        return f"unreadable COMPLETE marker ({err})"
    actual = _manifest(path)
    for name, size in expected.items():
        if name not in actual:
            return f"file {name} is missing"
        if actual[name] != size:
            return f"file {name} has {actual[name]} bytes, {size} expected (truncated or overwritten)"
    return None


def step_dirs(run_dir: Path) -> list[Path]:
    """All `step_N` directories of a run, newest first, complete or not."""
    base = root(run_dir)
    if not base.is_dir():
        return []
    found = [p for p in base.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()]
    return sorted(found, key=step_of, reverse=True)


def good_checkpoints(run_dir: Path, *, warn: bool = True) -> list[Path]:
    """Complete checkpoints of a run, newest first; incomplete ones are named in a warning."""
    good = []
    for path in step_dirs(run_dir):
        reason = problem(path)
        if reason is None:
            good.append(path)
        elif warn:
            warnings.warn(f"skipping checkpoint {path}: {reason}", stacklevel=2)
    return good


def resolve_resume(resume: str, run_dir: Path | None) -> list[Path]:
    """Checkpoints to try for `resume` (auto, a run directory or a checkpoint), newest first."""
    if resume == "auto":
        return good_checkpoints(run_dir) if run_dir is not None else []
    path = Path(resume)
    if (path / MARKER).exists() or path.name.startswith("step_"):
        return [path] if problem(path) is None else []
    return good_checkpoints(path)


def save(
    run_dir: Path,
    step: int,
    write: Callable[[Path], None],
    *,
    keep: int,
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """Write a checkpoint at `step` through `write(directory)` on every rank, then commit it atomically.

    Rank 0 prepares the partial directory and, after every rank has written, writes the marker,
    renames the directory and prunes old checkpoints. A failure leaves earlier checkpoints untouched.
    """
    base = root(run_dir)
    partial = base / f"{PARTIAL_PREFIX}step_{step}"
    final = base / f"step_{step}"
    if is_main:
        base.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    barrier()
    try:
        write(partial)
        barrier()
        if is_main:
            _commit(partial, final, step)
            prune(run_dir, keep)
    except OSError as err:
        if is_main:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointSaveError(
            f"could not write the checkpoint for step {step} under {base}: {err}. "
            "The previous complete checkpoint is intact; free disk space or set checkpoint.every "
            "higher, then resume with resume=auto."
        ) from err
    barrier()
    return final


def _commit(partial: Path, final: Path, step: int) -> None:
    """Mark `partial` complete, move it to `final` and point `latest` at it."""
    marker = {"step": step, "files": _manifest(partial)}
    _fsync_write(partial / MARKER, json.dumps(marker, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    pointer = final.parent / f"{LATEST}.tmp"
    _fsync_write(pointer, final.name + "\n")
    os.replace(pointer, final.parent / LATEST)


def prune(run_dir: Path, keep: int) -> None:
    """Delete complete checkpoints beyond the newest `keep`, and leftovers of failed saves."""
    good = good_checkpoints(run_dir, warn=False)
    for old in good[max(keep, 1) :]:
        shutil.rmtree(old, ignore_errors=True)
    newest = step_of(good[0]) if good else -1
    for path in root(run_dir).iterdir():
        stale_partial = path.name.startswith(PARTIAL_PREFIX)
        stale_incomplete = path.name.startswith("step_") and path not in good and step_of(path) < newest
        if path.is_dir() and (stale_partial or stale_incomplete):
            shutil.rmtree(path, ignore_errors=True)


def save_tensor_file(obj: object, path: Path) -> None:
    """torch.save to `path` (inside a partial checkpoint directory: `save` makes the whole directory atomic)."""
    import torch

    torch.save(obj, path)


def load_tensor_file(path: Path) -> object:
    """torch.load with weights_only=True: checkpoints never execute code on load."""
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)
