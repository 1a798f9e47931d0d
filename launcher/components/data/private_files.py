"""The token cache is private to its user: it holds a copy of the training data (directories 0700, files 0600).

Everything the cache writes (our token files, meta.json, `datasets`' Arrow files and locks) is
created under a umask of 077 while a corpus is built, and the trees it owns are tightened after,
so a cache left by an older version becomes private the next time it is used. A folder the user
names in data.cache_dir keeps its own mode; what is written inside it is private.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


@contextmanager
def private_umask() -> Iterator[None]:
    """New files and directories readable by their owner alone while the block runs."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def private_dirs(path: Path) -> Path:
    """`path` and its missing parents created 0700 (an existing one is left as it is); returns `path`."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        folder.mkdir(mode=PRIVATE_DIR, exist_ok=True)
        os.chmod(folder, PRIVATE_DIR)
    return path


def make_private(root: Path) -> None:
    """Every directory (0700) and file (0600) under `root`, `root` included, that this user owns."""
    if not root.exists():
        return
    uid = os.getuid()

    def tighten(path: Path, mode: int) -> None:
        info = path.lstat()
        if info.st_uid == uid and not stat.S_ISLNK(info.st_mode) and stat.S_IMODE(info.st_mode) != mode:
            os.chmod(path, mode)

    tighten(root, PRIVATE_DIR)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            tighten(Path(dirpath) / name, PRIVATE_DIR)
        for name in filenames:
            tighten(Path(dirpath) / name, PRIVATE_FILE)
