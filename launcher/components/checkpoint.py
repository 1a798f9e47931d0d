"""Atomic, verifiable checkpoints: write to a partial directory, mark complete last, rename, prune.

A checkpoint counts only once its COMPLETE marker (a manifest of every file with its size and
XXH3-128 digest, launcher.components.checkpoint_files) is written, after all files, and its directory is
renamed from `.partial_step_N` to `step_N`. Every rank must succeed: a failure on any rank (a full
disk, an I/O error) removes the partial directory on every rank's word, and the previous checkpoint
stays as it was. Resume follows `latest` and each checkpoint's recorded parent (checkpoint_lineage), skips any whose marker is
missing or whose sizes differ (`good_checkpoints`), and, before loading, re-reads the files and
compares their digests (`checkpoint_files.verify_while`, beside the load). Pruning counts only checkpoints that
this session sealed or whose files it verified, keeps the one it resumed from until a newer one
verifies and the newest one written before non-finite steps began, names every checkpoint it
removes, and moves damaged ones into checkpoints/damaged/ instead of deleting them.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.components import checkpoint_best
from launcher.components.checkpoint_files import (
    MARKER,
    CheckpointFiles,
    content_problem,
    merge_digests,
    read_manifest,
    size_problem,
    total_bytes,
)
from launcher.components.checkpoint_lineage import PARENT, lineage, parent_of
from launcher.components.files import safe_load
from launcher.config.checkpoint import LATEST, PARTIAL_PREFIX, SPACE_MARGIN

LOG = logging.getLogger(__name__)
"""Pruning names every checkpoint it removes or sets aside here, one line each (stderr by default)."""
DAMAGED = "damaged"
"""Under checkpoints/: damaged checkpoints, moved aside (not listed, not counted, not deleted)."""
ABANDONED = "abandoned"
"""Under checkpoints/: checkpoints of a branch a resume left (not the line `latest` descends from), kept."""


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


def problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted by its sizes (no file is read), or None."""
    return size_problem(path)


def step_dirs(run_dir: Path) -> list[Path]:
    """All `step_N` directories of a run, newest first, complete or not."""
    base = root(run_dir)
    if not base.is_dir():
        return []
    found = [p for p in base.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()]
    return sorted(found, key=step_of, reverse=True)


def good_checkpoints(run_dir: Path, *, warn: bool = True, among: list[Path] | None = None) -> list[Path]:
    """Complete checkpoints of a run (or of `among`), newest first; incomplete ones are named in a warning."""
    good = []
    for path in step_dirs(run_dir) if among is None else among:
        reason = problem(path)
        if reason is None:
            good.append(path)
        elif warn:
            warnings.warn(f"skipping checkpoint {path}: {reason}", stacklevel=2)
    return good


def resolve_resume(resume: str, run_dir: Path | None, *, warn: bool = True) -> list[Path]:
    """Checkpoints to try for `resume` (auto, a run directory or a checkpoint), newest first.

    For a run directory (run_dir with auto): the line its `latest` descends from, not the highest
    steps (launcher.components.checkpoint_lineage).
    """
    path = run_dir if resume == "auto" else Path(resume)
    if path is None:
        return []
    if resume != "auto" and ((path / MARKER).exists() or path.name.startswith("step_")):
        return [path] if problem(path) is None else []
    return good_checkpoints(path, warn=warn, among=lineage(root(path), step_dirs(path)))


def unfinished(run_dir: Path) -> list[Path]:
    """Partial directories that a save which did not finish left behind."""
    base = root(run_dir)
    return sorted(p for p in base.iterdir() if p.name.startswith(PARTIAL_PREFIX)) if base.is_dir() else []


def space_warning(run_dir: Path) -> str | None:
    """A warning when the filesystem has less room than the last checkpoint took (SPACE_MARGIN), else None."""
    good = good_checkpoints(run_dir, warn=False)
    if not good:
        return None
    needed, free = total_bytes(good[0]), shutil.disk_usage(root(run_dir)).free
    if free >= SPACE_MARGIN * needed:
        return None
    return (
        f"only {free:,} bytes are free under {root(run_dir)}, and the last checkpoint took {needed:,}: "
        "the next save may fail (the previous checkpoint stays intact if it does). Free space, or lower "
        "checkpoint.keep."
    )


def save(
    run_dir: Path,
    step: int,
    write: Callable[[CheckpointFiles], None],
    *,
    keep: int,
    rank: int = 0,
    agree: Callable[[bool], bool] = lambda ok: ok,
    info: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint at `step` through `write(files)` on every rank, then commit it atomically.

    Rank 0 prepares the partial directory and, once every rank reports success (`agree`, a
    collective AND), writes the manifest, renames the directory and prunes old checkpoints. Any
    failure on any rank removes the partial directory and raises CheckpointSaveError on every rank;
    earlier checkpoints are untouched. `info` goes into the manifest (e.g. the non-finite count).
    """
    base = root(run_dir)
    partial, final = base / f"{PARTIAL_PREFIX}step_{step}", base / f"step_{step}"
    is_main = rank == 0
    # Every rank takes the same path through the agreements below (each is a collective).
    error = attempt(prepare, partial) if is_main else None
    if agree(error is None):
        error = attempt(_write, partial, rank, write)
        if agree(error is None):
            if is_main:
                error = attempt(lambda: commit(run_dir, partial, final, step, info or {}, keep=keep))
        else:
            error = error or RuntimeError("another rank failed while writing its part")
    else:
        error = error or RuntimeError("rank 0 could not prepare the checkpoint directory")
    if not agree(error is None):
        if is_main:
            raise CheckpointSaveError(failure_text(run_dir, partial, step, error))
        raise CheckpointSaveError(
            f"the checkpoint of step {step} was not written ({error or 'rank 0 failed'})."
        )
    return final


def attempt(action: Callable[..., None], *args: Any) -> BaseException | None:
    """Run `action`; the exception it raised, else None (torch raises RuntimeError on a full disk)."""
    try:
        action(*args)
    except Exception as err:
        return err
    return None


def prepare(partial: Path) -> None:
    """Rank 0: an empty partial directory for a new checkpoint (a leftover of a failed save removed)."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()


def _write(partial: Path, rank: int, write: Callable[[CheckpointFiles], None]) -> None:
    files = CheckpointFiles(partial, rank)
    write(files)
    files.finish()


def failure_text(run_dir: Path, partial: Path, step: int, error: BaseException | None) -> str:
    """Remove the partial directory; one paragraph: what failed, bytes needed and free, what is intact."""
    written = sum(p.stat().st_size for p in partial.rglob("*") if p.is_file()) if partial.exists() else 0
    shutil.rmtree(partial, ignore_errors=True)
    good = good_checkpoints(run_dir, warn=False)
    needed = max(total_bytes(good[0]) if good else 0, written)
    free = shutil.disk_usage(root(run_dir)).free
    intact = f"The previous checkpoint {good[0]} is intact" if good else "No earlier checkpoint exists"
    return (
        f"could not write the checkpoint of step {step} in {partial} ({type(error).__name__}: "
        f"{str(error).splitlines()[0] if error else 'unknown'}). It needs about {needed:,} bytes and "
        f"{free:,} bytes are free there now (the unfinished checkpoint was removed). {intact}; free "
        "space (or lower checkpoint.keep) and continue with resume=auto."
    )


def _commit(partial: Path, final: Path, step: int, info: dict[str, Any]) -> None:
    """Mark `partial` complete (the manifest of every file), move it to `final`, point `latest` at it."""
    import json

    marker = {"step": step, **info, "files": merge_digests(partial)}
    _fsync_write(partial / MARKER, json.dumps(marker, indent=1))
    if final.exists() or final.is_symlink():  # e.g. a file where the directory belongs: kept, not deleted
        LOG.warning("%s was in the way of the checkpoint of step %d: moved aside to %s", final, step,
                    set_aside(final.parent.parent, final))  # fmt: skip
    os.replace(partial, final)
    pointer = final.parent / f"{LATEST}.tmp"
    _fsync_write(pointer, final.name + "\n")
    os.replace(pointer, final.parent / LATEST)


def commit(run_dir: Path, partial: Path, final: Path, step: int, info: dict[str, Any], *, keep: int) -> None:
    """Rank 0, once every rank's part is written: seal `partial` as `final` with its parent (the checkpoint this
    session continues from), record it as this session's, prune."""
    state = session(run_dir)
    _commit(partial, final, step, {PARENT: state.newest_sealed or state.resumed_from, **info})
    checkpoint_best.after_commit(final.parent, info)  # checkpoint.keep_best: checkpoints/best
    _sealed(run_dir, final)
    prune(run_dir, keep)


def _nonfinite_count(path: Path) -> int:
    try:
        return int(read_manifest(path).get("nonfinite_skips", 0))
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def protected(good: list[Path]) -> Path | None:
    """The checkpoint written just before the current run of non-finite steps began, kept whatever
    `keep` says; None when the newest interval between checkpoints had no non-finite step."""
    counts = [_nonfinite_count(p) for p in good]
    for i in range(len(good) - 1):
        if (
            counts[i + 1] >= counts[i]
        ):  # no skipped step between good[i + 1] and good[i]: the run began after good[i]
            return good[i] if i > 0 else None
    return good[-1] if len(good) > 1 else None  # skips in every interval: the oldest one left


@dataclass
class Session:
    """What this process knows of a run's checkpoints: the ones it verified or sealed, the one it resumed from."""

    trusted: set[str] = field(default_factory=set)
    """Names of step directories whose files this session hashed: sealed by its saves or verified by it."""
    resumed_from: str | None = None
    """The step directory this session resumed from, when it is one of this run's."""
    newest_sealed: str | None = None
    """The step directory this session's last save wrote: never removed by its own pruning."""


_SESSIONS: dict[Path, Session] = {}
"""Each run's checkpoints directory -> this process's session record of it."""


def session(run_dir: Path) -> Session:
    """This process's record of the run's checkpoints (a new session until `start_session` or a save)."""
    return _SESSIONS.setdefault(root(run_dir).resolve(), Session())


def start_session(run_dir: Path) -> Session:
    """Forget what an earlier session in this process knew: a new session trusts nothing it did not hash."""
    _SESSIONS[root(run_dir).resolve()] = Session()
    return session(run_dir)


def _sealed(run_dir: Path, path: Path) -> None:
    """Record a checkpoint this session wrote and hashed as it wrote it: trusted without a second read."""
    state = session(run_dir)
    state.trusted.add(path.name)
    state.newest_sealed = path.name


def is_own(run_dir: Path, path: Path) -> bool:
    """Whether `path` is a checkpoint directory of this run (not of another run resumed from)."""
    return Path(path).resolve().parent == root(run_dir).resolve()


def resumed(run_dir: Path, path: Path, *, verified: bool) -> None:
    """Record the checkpoint this session resumed from (kept until a newer one verifies)."""
    if is_own(run_dir, path):
        state = session(run_dir)
        state.resumed_from = Path(path).name
        if verified:
            state.trusted.add(Path(path).name)


def set_aside(run_dir: Path, path: Path, folder: str = DAMAGED) -> Path:
    """Move a checkpoint (or whatever is at its path) into checkpoints/damaged/ or `folder` (never resumed from,
    never counted, never deleted); its new place. `latest`, when it named it, names its parent (or the newest)."""
    base = root(run_dir)
    aside = base / folder
    aside.mkdir(exist_ok=True)
    target = aside / path.name
    for copy in range(1, 1000):
        if not (target.exists() or target.is_symlink()):
            break
        target = aside / f"{path.name}.{copy}"
    parent = parent_of(path) if path.is_dir() else None
    os.replace(path, target)
    session(run_dir).trusted.discard(path.name)
    _repoint_latest(base, parent if isinstance(parent, str) else None)
    return target


def damaged(run_dir: Path) -> list[Path]:
    """Checkpoints of a run that were set aside as damaged, oldest first."""
    base = root(run_dir) / DAMAGED
    return sorted(base.iterdir(), key=lambda p: p.name) if base.is_dir() else []


def _repoint_latest(base: Path, parent: str | None = None) -> None:
    """Point `latest` at `parent` or else the newest complete checkpoint left, when what it named was moved or removed."""
    pointer = base / LATEST
    if not pointer.is_file() or (base / pointer.read_text().strip()).is_dir():
        return
    good = good_checkpoints(base.parent, warn=False)
    if not good:
        pointer.unlink()
        return
    point_latest(base, next((p for p in good if p.name == parent), good[0]).name)


def point_latest(base: Path, name: str) -> None:
    """Make checkpoints/latest name the step directory `name` (atomically)."""
    staged = base / f"{LATEST}.tmp"
    _fsync_write(staged, name + "\n")
    os.replace(staged, base / LATEST)


def _verifies(run_dir: Path, path: Path) -> bool:
    """Whether a checkpoint's files match its manifest: trusted ones are not read again; damaged ones are set aside."""
    state = session(run_dir)
    if path.name in state.trusted:
        return True
    reason = content_problem(path)
    if reason is None:
        state.trusted.add(path.name)
        return True
    LOG.warning("checkpoint %s is damaged (%s): moved aside to %s", path, reason, set_aside(run_dir, path))
    return False


def prune(run_dir: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints that verify; remove older ones, naming each; set damaged ones aside.

    A checkpoint counts toward `keep` only when this session sealed it or its files match their
    digests (read once per session); one that does not is moved to checkpoints/damaged/. The
    session's newest checkpoint stays, the one it resumed from until a newer one verifies, the one written
    before the current run of non-finite steps and the one checkpoints/best names, whatever `keep` says.
    """
    keep = max(keep, 1)
    counted: list[Path] = []
    for path in good_checkpoints(run_dir, warn=False):
        if len(counted) == keep:
            break
        if _verifies(run_dir, path):
            counted.append(path)
    left, state, base = good_checkpoints(run_dir, warn=False), session(run_dir), root(run_dir)
    keepers = {*counted, protected(left), checkpoint_best.named(base)}
    if state.newest_sealed is not None:  # kept even below higher-numbered ones of an earlier timeline
        keepers.add(base / state.newest_sealed)
    origin = state.resumed_from
    if origin is not None and all(step_of(p) <= step_of(base / origin) for p in counted):
        keepers.add(base / origin)
    newer = ", ".join(p.name for p in counted)
    for old in left:
        if old not in keepers:
            shutil.rmtree(old, ignore_errors=True)
            LOG.warning("removed checkpoint %s (checkpoint.keep=%d; newer ones verify: %s)", old, keep, newer)
    _clear_leftovers(run_dir, newest=step_of(left[0]) if left else -1)


def _clear_leftovers(run_dir: Path, *, newest: int) -> None:
    """Remove what failed saves left (.partial_*); set aside step directories older than `newest` that are incomplete."""
    for path in root(run_dir).iterdir():
        if path.is_dir() and path.name.startswith(PARTIAL_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
    for path in step_dirs(run_dir):
        if step_of(path) < newest and (reason := problem(path)) is not None:
            LOG.warning(
                "checkpoint %s is incomplete (%s): moved aside to %s", path, reason, set_aside(run_dir, path)
            )


def load_tensor_file(path: Path) -> object:
    """torch.load with weights_only=True: checkpoints never execute code on load (RefusedFile names a file that would)."""
    return safe_load.load_tensor_file(path)
