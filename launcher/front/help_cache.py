"""`train --help` from a cache: the text depends only on the command line and the shipped code and
config files, so once printed it is kept and printed again without importing Hydra or the schemas.

The key hashes the command line, the Python version and the path, size and modification
time of every file of the package (its version too) and of conf/ (a changed option file or schema makes
a new key). Command lines that read a user's config directories (--config-dir, --config-path,
hydra.searchpath) are never cached: those files are not in the key. The cache lives under
$XDG_CACHE_HOME/torch-launcher/help (default ~/.cache); a file that cannot be written is skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

HELP_FLAGS = ("--help", "-h")
UNCACHED = ("--config-dir", "-cd", "--config-path", "-cp", "hydra.searchpath", "+hydra.searchpath")


def cacheable(argv: list[str]) -> bool:
    """Whether `argv` asks for the help only, from the shipped configs."""
    names = [arg.split("=", 1)[0] for arg in argv]
    return any(name in HELP_FLAGS for name in names) and not any(name in UNCACHED for name in names)


def _files(root: Path) -> Iterator[str]:
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False):
            if entry.name != "__pycache__":
                yield from _files(Path(entry.path))
        elif entry.name.endswith((".py", ".yaml")):
            stat = entry.stat()
            yield f"{entry.path}:{stat.st_size}:{stat.st_mtime_ns}"


def _key(argv: list[str]) -> str:
    package = Path(__file__).resolve().parents[1]  # launcher/: its files (the version's too) are in the key
    conf = package / "conf"
    roots = [package] + ([] if conf.is_dir() else [package.parent / "conf"])  # editable: conf/ beside it
    digest = hashlib.sha256("\0".join([sys.version, *argv]).encode())
    for root in roots:
        if root.is_dir():
            for line in _files(root):
                digest.update(line.encode())
    return digest.hexdigest()[:32]


def _path(argv: list[str]) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "torch-launcher" / "help" / f"{_key(argv)}.txt"


def cached(argv: list[str]) -> str | None:
    """The help text printed before for `argv`, or None."""
    try:
        return _path(argv).read_text()
    except OSError:
        return None


def print_and_keep(argv: list[str], print_help: Callable[[], int]) -> int:
    """Run `print_help` (which prints the help to stdout), keep what it printed; its exit status."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        try:
            status = print_help()
        except SystemExit as stop:  # Hydra's app exits after printing
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    text = buffer.getvalue()
    sys.stdout.write(text)
    if status == 0 and text.strip():
        path = _path(argv)
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(text)
            tmp.replace(path)
    return status
