"""The command line shared by the offline tools (train-export, train-merge, train-quantize, train-generate)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launcher.components import quiet

RUN_OR_STEP = "a run directory (its newest checkpoint) or a checkpoints/step_N directory"


def tool_parser(
    prog: str, description: str, *, folders: bool = False, epilog: str | None = None
) -> argparse.ArgumentParser:
    """A tool's argument parser with what every tool reads first: a run or one of its checkpoints, and for the
    tools that take one (`folders`), a Hugging Face model folder (then the argument is `source`)."""
    parser = ToolParser(prog=prog, description=description, epilog=epilog)
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show other libraries' progress bars and notices (off by default)",
    )
    if folders:
        parser.add_argument("source", type=Path, help=f"{RUN_OR_STEP}, or a Hugging Face model folder")
    else:
        parser.add_argument("checkpoint", type=Path, help=RUN_OR_STEP)
    return parser


class ToolParser(argparse.ArgumentParser):
    """An argument parser that quiets other libraries' chatter once the arguments are read (unless --verbose)."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # noqa: ANN401
        """The arguments; before any library is imported, launcher.components.quiet as --verbose says."""
        parsed = super().parse_args(args, namespace)
        quiet.install(verbose=parsed.verbose)
        return parsed


def output_folder_problem(out: Path) -> str | None:
    """Why a tool may not put `out` where it names: its folder is a file, or neither its folder nor that folder's
    parent exists (a tool creates at most OUT's own folder, never a path of missing folders); None when it may."""
    parent = out.absolute().parent
    if parent.exists() and not parent.is_dir():
        return f"{parent} is a file, not a folder: give an OUT inside an existing folder."
    if parent.is_dir() or parent.parent.is_dir():
        return None
    missing = parent
    while not missing.parent.exists():
        missing = missing.parent
    return (
        f"{out}: its folder {parent} does not exist, nor does {missing} (a tool creates at most OUT's own folder, "
        f"so a mistyped path does not become new folders). Create the folders first (mkdir -p {parent}) or "
        "give an OUT in an existing folder."
    )


def output_file_problem(out: Path, *, force: bool) -> str | None:
    """Why a tool may not write the file `out` (a folder there, missing folders, or a file without --force);
    None when it may."""
    if problem := output_folder_problem(out):
        return problem
    if out.is_dir():
        return f"{out} is a folder; this command writes one file. Give a file path for OUT (e.g. {out / 'model.pt'})."
    if out.exists() and not force:
        return (
            f"{out} already exists; the command would overwrite it. Give another OUT, or add --force to replace "
            "it (the old file is replaced only once the new one is completely written)."
        )
    return None
