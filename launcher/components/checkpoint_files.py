"""The files of a checkpoint and their manifest: a SHA-256 of every file, taken while it is written.

Every rank writes its part of a checkpoint through a `CheckpointFiles`: `save` streams torch.save
through SHA-256 as the bytes go to disk (no second read), `adopt` hashes files that a library
wrote itself (DCP shards, DeepSpeed's files), right after they were written, while they are still
in the page cache. Each rank leaves its digests in `.digests_rank<R>.json`; rank 0 merges them into
the COMPLETE marker (hashing any file nobody declared, so nothing goes unverified). `verify`
re-reads a checkpoint and compares: a same-size overwrite is caught, not only a truncation.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MARKER = "COMPLETE"
"""The manifest, written last: its presence makes a checkpoint complete."""
DIGESTS_PREFIX = ".digests_rank"
"""Per-rank digest files, merged into the manifest at commit and removed."""
CHUNK_BYTES = 8 * 2**20


class _HashingWriter(io.RawIOBase):
    """A write-only file object that hashes what passes through it."""

    def __init__(self, handle: io.BufferedWriter) -> None:
        super().__init__()
        self._handle = handle
        self.digest = hashlib.sha256()
        self.num_bytes = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        view = memoryview(data)
        self.digest.update(view)
        self.num_bytes += view.nbytes
        return self._handle.write(view)

    def flush(self) -> None:
        self._handle.flush()


def _fsync(path: Path) -> None:
    """Flush a file's data to disk (the manifest is written only after every file is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path) -> tuple[int, str]:
    """(bytes, SHA-256 hex) of a file, read in chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


class CheckpointFiles:
    """One rank's writes into a partial checkpoint directory, each file with its SHA-256."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.directory = Path(directory)
        """The partial checkpoint directory (every rank writes into the same one)."""
        self.rank = rank
        """This rank."""
        self.digests: dict[str, dict[str, Any]] = {}

    def save(self, obj: object, name: str) -> None:
        """torch.save `obj` to directory/name, hashing the bytes as they are written."""
        import torch

        path = self.directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as handle:
            writer = _HashingWriter(handle)
            torch.save(obj, writer)
            handle.flush()
            os.fsync(handle.fileno())
        self.digests[name] = {"bytes": writer.num_bytes, "sha256": writer.digest.hexdigest()}

    def adopt(self, paths: Iterable[Path]) -> None:
        """Record files a library wrote into the directory (read back once, from the page cache)."""
        for path in paths:
            size, digest = file_digest(path)
            _fsync(path)
            self.digests[str(Path(path).relative_to(self.directory))] = {"bytes": size, "sha256": digest}

    def finish(self) -> None:
        """Leave this rank's digests for rank 0's manifest."""
        target = self.directory / f"{DIGESTS_PREFIX}{self.rank}.json"
        target.write_text(json.dumps(self.digests))


def merge_digests(directory: Path) -> dict[str, dict[str, Any]]:
    """Every file of the directory with its bytes and SHA-256: the ranks' digests, plus any file none declared."""
    files: dict[str, dict[str, Any]] = {}
    for digest_file in sorted(directory.glob(f"{DIGESTS_PREFIX}*.json")):
        files.update(json.loads(digest_file.read_text()))
        digest_file.unlink()
    for path in sorted(directory.rglob("*")):
        name = str(path.relative_to(directory))
        if path.is_file() and name != MARKER and name not in files:
            size, digest = file_digest(path)
            files[name] = {"bytes": size, "sha256": digest}
    return files


def read_manifest(path: Path) -> dict[str, Any]:
    """The COMPLETE marker of a checkpoint (KeyError/ValueError when it is not readable)."""
    manifest = json.loads((Path(path) / MARKER).read_text())
    manifest["files"] = {  # manifests before content hashes recorded sizes only
        name: entry if isinstance(entry, dict) else {"bytes": entry}
        for name, entry in manifest["files"].items()
    }
    return manifest


def size_problem(path: Path) -> str | None:
    """Why a checkpoint is incomplete by its sizes (cheap: no file is read), or None."""
    if not (Path(path) / MARKER).is_file():
        return "no COMPLETE marker (the save did not finish)"
    try:
        expected = read_manifest(path)["files"]
    except (ValueError, KeyError, TypeError) as err:
        return f"unreadable COMPLETE marker ({err})"
    for name, entry in expected.items():
        file = Path(path) / name
        if not file.is_file():
            return f"file {name} is missing"
        size = file.stat().st_size
        if size != entry["bytes"]:
            return f"file {name} has {size} bytes, {entry['bytes']} expected (truncated or overwritten)"
    return None


def content_problem(path: Path) -> str | None:
    """Why a checkpoint's contents differ from its manifest (every file is read and hashed), or None."""
    problem = size_problem(path)
    if problem is not None:
        return problem
    for name, entry in read_manifest(path)["files"].items():
        if "sha256" not in entry:
            continue  # written before content hashes: sizes were checked
        if file_digest(Path(path) / name)[1] != entry["sha256"]:
            return f"file {name} does not match the SHA-256 its manifest recorded (changed on disk)"
    return None


def total_bytes(path: Path) -> int:
    """Bytes of a complete checkpoint, from its manifest (0 when unreadable)."""
    try:
        return sum(entry["bytes"] for entry in read_manifest(path)["files"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return 0
