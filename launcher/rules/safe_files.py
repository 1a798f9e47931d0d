"""Rules of the files a run reads from earlier runs: none may name code, checked before anything starts.

The checkpoints `resume` names and a teacher run's newest checkpoint are read by the ranks through
allowlists (launcher.components.files.safe_load, launcher.components.files.dcp_reader). Their DCP metadata is
small, so it is read here too: a `.metadata` that names code is refused with exit status 2 before
any process starts, naming the file. Tensor files are left to the ranks' weights-only reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from launcher.components import checkpoint
from launcher.components.checkpoint_files import MARKER
from launcher.components.files.safe_load import RefusedFile, refused_yaml
from launcher.parallel.checkpoint_layout import DCP_DIR, is_dcp_checkpoint
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError


def code_in_metadata(step_dir: Path) -> RefusedFile | None:
    """The refusal of a checkpoint's DCP metadata when it names code; None when it names none or there is none."""
    if not is_dcp_checkpoint(step_dir):
        return None
    from launcher.components.files.dcp_reader import read_metadata

    try:
        read_metadata(Path(step_dir) / DCP_DIR / ".metadata")
    except RefusedFile as err:
        return err if err.names_code else None  # a malformed file is damage: the rank skips it
    return None


def _resume_dirs(spec: RunSpec) -> list[Path]:
    """Every checkpoint the ranks may load for `resume`, newest first."""
    if spec.resume is None or (spec.resume == "auto" and spec.run_dir is None):
        return []
    path = Path(spec.run_dir) if spec.resume == "auto" else Path(spec.resume)
    if path.name.startswith("step_") or (path / MARKER).exists():
        return [path]
    return checkpoint.good_checkpoints(path, warn=False) if path.is_dir() else []


def _resume_files(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    for step_dir in _resume_dirs(spec):
        refused = code_in_metadata(step_dir)
        if refused is not None:
            yield SpecError(("resume",), str(refused))
            return


def _teacher_files(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    teacher = Path(spec.distill.teacher) if spec.distill.teacher else None
    if teacher is None or not (teacher / "spec.yaml").is_file():
        return
    good = checkpoint.good_checkpoints(teacher, warn=False)
    refused = code_in_metadata(good[0]) if good else None
    if refused is not None:
        yield SpecError(("distill.teacher",), str(refused))


SPEC_ADVICE = (
    "A run writes spec.yaml as plain YAML, so this one was changed after it was written; it is left as it is, "
    "and no run writes over it. Keep it as evidence and choose another run_dir, or restore it from a source "
    "you trust and run again."
)
"""What to do about a spec.yaml that names code (left in place: it is evidence of a change)."""


def _spec_files(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    """The run directory's own spec.yaml (a run would write over it) and the one of the run `resume` names."""
    own = Path(spec.run_dir) if spec.run_dir else None
    dirs = [(("run_dir",), own)] if own is not None else []
    if spec.resume not in (None, "auto"):
        path = Path(spec.resume)
        other = path.parent.parent if path.name.startswith("step_") or (path / MARKER).exists() else path
        if own is None or other.resolve() != own.resolve():
            dirs.append((("resume",), other))
    for keys, run_dir in dirs:
        refused = refused_yaml(run_dir / "spec.yaml", SPEC_ADVICE)
        if refused is not None:
            yield SpecError(keys, str(refused))


RULES: tuple[Rule, ...] = (_spec_files, _resume_files, _teacher_files)
"""This module's rules, in the order they report."""
