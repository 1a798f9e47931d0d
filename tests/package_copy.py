"""A copy of the package that a "How to add ..." recipe of docs/architecture.md is followed on, and run from."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import launcher

REPO = Path(launcher.__file__).parent.parent


def copy_package(root: Path) -> Path:
    """The package (conf/ inside it, as a plain install ships it) copied under `root`; `root`."""
    shutil.copytree(
        REPO / "launcher", root / "launcher", ignore=shutil.ignore_patterns("__pycache__", "conf")
    )
    shutil.copytree(REPO / "conf", root / "launcher" / "conf", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def edit(path: Path, anchor: str, insert: str, *, after: bool = True) -> None:
    """Insert `insert` after (or before) `anchor`, which must stand in `path` exactly once."""
    text = path.read_text()
    assert text.count(anchor) == 1, f"{path}: the recipe's anchor {anchor!r} is not there exactly once"
    path.write_text(text.replace(anchor, anchor + insert if after else insert + anchor))


def recipe_paths(heading: str, placeholders: dict[str, str]) -> set[str]:
    """The repository files the recipe under `heading` names, its placeholders (`<name>`) filled in."""
    text = (REPO / "docs" / "architecture.md").read_text()
    recipe = text.split(heading, 1)[1].split("\n\n**", 1)[0].split("\n\n## ", 1)[0]
    names = re.findall(r"`((?:launcher|conf|tests)/[^`:\s]+)", recipe)
    for placeholder, value in placeholders.items():
        names = [n.replace(placeholder, value) for n in names]
    return set(names)


def run_python(root: Path, *args: str, timeout: int) -> subprocess.CompletedProcess:
    """`python ARGS` in the copy at `root`, importing the copy's package, the console plain and wide."""
    env = {**os.environ, "PYTHONPATH": str(root), "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=timeout
    )
