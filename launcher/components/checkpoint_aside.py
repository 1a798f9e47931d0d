"""What rank 0 moves out of a run's checkpoints/ before and after a resume, each with a line for the console.

Nothing is deleted: a damaged checkpoint (a file missing, truncated or emptied, a COMPLETE marker
missing or garbage, one that verifies but does not load) goes to checkpoints/damaged/, a path in
the way of a checkpoint (a file named step_N) too, and the checkpoints of a branch a resume left
(not the line the resumed checkpoint descends from: launcher.components.checkpoint_lineage) go to
checkpoints/abandoned/. Neither folder is resumed from or counted by `checkpoint.keep`, and no save
writes over what they hold.
"""

from __future__ import annotations

from pathlib import Path

from launcher.components import checkpoint, checkpoint_best
from launcher.components.checkpoint_lineage import descent
from launcher.components.files.safe_load import RefusedFile, named_global


def code_in(step_dir: Path) -> RefusedFile | None:
    """The refusal of the first file of a checkpoint that names code, read without running anything (its torch
    files' pickles as opcodes, its DCP metadata through the allowlist), or None: checked before a checkpoint
    whose files changed is set aside as damaged, since one that names code is evidence and stops the run."""
    for path in sorted(Path(step_dir).rglob("*.pt")):
        named = named_global(path)
        if named is not None:
            return RefusedFile(path, f"it names {named}", names_code=True)
    metadata = Path(step_dir) / "dcp" / ".metadata"
    if metadata.is_file():
        from launcher.components.files.dcp_reader import read_metadata

        try:
            read_metadata(metadata)
        except RefusedFile as err:
            return err if err.names_code else None
    return None


def _in_the_way(run_dir: Path) -> list[Path]:
    """Paths named step_N under checkpoints/ that are not directories (a save there would fail)."""
    base = checkpoint.root(run_dir)
    if not base.is_dir():
        return []
    return sorted(
        p for p in base.iterdir() if p.name.startswith("step_") and p.name[5:].isdigit() and not p.is_dir()
    )


def code_in_incomplete(run_dir: Path) -> RefusedFile | None:
    """The refusal of the first file naming code among the run's incomplete checkpoints (what `tidy` would move)."""
    for path in checkpoint.step_dirs(run_dir):
        if checkpoint.problem(path) is not None and (refused := code_in(path)) is not None:
            return refused
    return None


def tidy(run_dir: Path) -> list[str]:
    """Rank 0, before a session resumes or saves: move paths in the way and incomplete checkpoints to damaged/;
    a line for each."""
    lines = []
    for path in _in_the_way(run_dir):
        lines.append(
            f"{path} is not a checkpoint directory (a file stands where checkpoints are written): moved aside to "
            f"{checkpoint.set_aside(run_dir, path)}"
        )
    for path in checkpoint.step_dirs(run_dir):
        reason = checkpoint.problem(path)
        if reason is not None:
            lines.append(
                f"checkpoint {path} is damaged ({reason}): moved aside to {checkpoint.set_aside(run_dir, path)}"
            )
    return lines


def damaged_after_resume(run_dir: Path, unloadable: dict[Path, str]) -> list[str]:
    """Rank 0, once an older checkpoint loaded (so the spec fits the run): move the run's own checkpoints that
    verified but did not load (path -> why) to damaged/."""
    return [
        f"checkpoint {path} is damaged ({reason}): moved aside to {checkpoint.set_aside(run_dir, path)}"
        for path, reason in unloadable.items()
        if checkpoint.is_own(run_dir, path) and path.is_dir()
    ]


def abandon_branches(run_dir: Path, resumed: Path) -> list[str]:
    """Rank 0, after resuming from `resumed` (one of this run's): move every checkpoint that is neither it, one of its
    ancestors nor the best its manifest records (checkpoint.keep_best) to checkpoints/abandoned/, and point `latest`
    (and checkpoints/best) at what it records; a line for each moved."""
    if not checkpoint.is_own(run_dir, resumed):
        return []
    dirs = checkpoint.step_dirs(run_dir)
    start = next((p for p in dirs if p.name == Path(resumed).name), None)
    line = set(descent(start, dirs)) if start is not None else set(dirs)
    best = checkpoint_best.recorded(Path(resumed))
    line.update(p for p in dirs if p.name == best)
    lines = []
    for path in dirs:
        if path not in line:
            target = checkpoint.set_aside(run_dir, path, checkpoint.ABANDONED)
            lines.append(
                f"checkpoint {path} belongs to a branch this run left (it continues from {Path(resumed).name}): "
                f"moved aside to {target}, not resumed, not counted by checkpoint.keep"
            )
    if lines:
        checkpoint.point_latest(checkpoint.root(run_dir), Path(resumed).name)
        checkpoint_best.point(checkpoint.root(run_dir), best)
    return lines
