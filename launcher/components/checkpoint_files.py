"""The files of a checkpoint and their manifest: a digest of every file, taken as it is written.

The digest is XXH3-128 (`DIGEST`): it finds damage (a torn write, a same-size overwrite, bit rot)
at over 20 GB/s on one core, where SHA-256 runs at about 1.8 GB/s and cost more CPU than the
whole torch.save. The manifest is no signature whatever the hash (whoever can change a file can
change the manifest), so a cryptographic hash bought nothing; files that name code are refused by
launcher.components.files instead. Manifests written with SHA-256 verify as before.

Every rank writes its part of a checkpoint through a `CheckpointFiles`. `save` streams torch.save
to the file and hashes each block in a second thread while the first writes it, then fsyncs the
file. torch's own CRC32 of every zip record is switched off for these files: torch.load never
checks it, and the digest of the whole file, checked before every resume, takes its place. `adopt` seals files that a library wrote
itself (DCP shards, DeepSpeed's files): fsync'ed while they are read back from the page cache and
hashed. Each rank leaves its digests in `.digests_rank<R>.json`; rank 0 merges them into the
COMPLETE marker (hashing any file nobody declared, so nothing goes unverified). `content_problem`
re-reads a checkpoint, its files in parallel, and compares: a same-size overwrite is caught, not
only a truncation.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

MARKER = "COMPLETE"
"""The manifest, written last: its presence makes a checkpoint complete."""
DIGEST = "xxh3_128"
"""The manifest's digest of every file written now (its key in each file's entry)."""
DIGEST_NAMES = {DIGEST: "XXH3-128 digest", "sha256": "SHA-256"}
"""Digests a manifest may hold (older checkpoints: SHA-256), as messages name them."""
DIGESTS_PREFIX = ".digests_rank"
"""Per-rank digest files, merged into the manifest at commit and removed."""
READ_BYTES = 16 * 2**20
"""One read while hashing: large, so that each read runs long without the GIL."""
HASH_THREADS = 4
"""Files hashed at once when a whole checkpoint is verified or adopted."""
PARALLEL_BYTES = 2**20
"""Blocks of torch.save from this size on are hashed in a second thread while they are written."""
_CRC_SWITCH = threading.Lock()


class _SealingWriter(io.RawIOBase):
    """A write-only file object: each block is written here and hashed in `pool` at the same time."""

    def __init__(self, handle: io.BufferedWriter, pool: Executor) -> None:
        super().__init__()
        self._handle, self._pool = handle, pool
        self.digest = new_digest(DIGEST)
        self.num_bytes = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        if view.nbytes < PARALLEL_BYTES:  # pickle bytes, headers, padding: not worth a hand-off
            self.digest.update(view)
            self._handle.write(view)
        else:  # a tensor's storage: valid until this call returns, so the hash is awaited here
            hashed = self._pool.submit(self.digest.update, view)
            try:
                self._handle.write(view)
            finally:
                hashed.result()
        self.num_bytes += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._handle.flush()


@contextlib.contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """torch.save skips its CRC32 of every record meanwhile (process-wide; saves here take turns)."""
    from torch.serialization import get_crc32_options, set_crc32_options

    with _CRC_SWITCH:
        before = get_crc32_options()
        set_crc32_options(False)
        try:
            yield
        finally:
            set_crc32_options(before)


def new_digest(kind: str) -> Any:
    """A fresh hash object of `kind` (DIGEST, or sha256 for older manifests)."""
    if kind == "sha256":
        return hashlib.sha256()
    import xxhash

    return xxhash.xxh3_128()


def file_digest(path: Path, *, sync: bool = False, kind: str = DIGEST) -> tuple[int, str]:
    """(bytes, hex digest of `kind`) of a file; with `sync`, the file is fsync'ed meanwhile, in another thread.

    Two buffers alternate: one is read into (a thread) while the other is hashed, so a read from
    the disk and the hashing overlap.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            flushed = pool.submit(os.fsync, fd) if sync else None
            digest, size = new_digest(kind), 0
            block = min(READ_BYTES, os.fstat(fd).st_size + 1)  # a small file: small buffers
            buffers = (bytearray(block), bytearray(block))
            pending = pool.submit(os.preadv, fd, [buffers[0]], 0)
            for turn in itertools.count():
                count = pending.result()
                if count == 0:
                    break
                size += count
                pending = pool.submit(os.preadv, fd, [buffers[(turn + 1) % 2]], size)
                digest.update(memoryview(buffers[turn % 2])[:count])
            if flushed is not None:
                flushed.result()
    finally:
        os.close(fd)
    return size, digest.hexdigest()


class CheckpointFiles:
    """One rank's writes into a partial checkpoint directory, each file with its digest.

    Thread-safe: `save` and `adopt` may run in several threads at once (on different files); the
    digests are guarded by a lock, and saves take turns only where torch's CRC32 switch is held.
    """

    def __init__(self, directory: Path, rank: int) -> None:
        self.directory = Path(directory)
        """The partial checkpoint directory (every rank writes into the same one)."""
        self.rank = rank
        """This rank."""
        self.digests: dict[str, dict[str, Any]] = {}
        """name (relative to the directory) -> {"bytes", DIGEST} of every file this rank sealed."""
        self._lock = threading.Lock()

    def save(self, obj: object, name: str) -> None:
        """torch.save `obj` to directory/name, hashing each block while it is written; fsync'ed before it returns."""
        import torch

        path = self.directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(max_workers=1) as pool, open(path, "wb") as handle:
            writer = _SealingWriter(handle, pool)
            with _without_zip_crc32():
                torch.save(obj, writer)
            handle.flush()
            os.fsync(handle.fileno())
        self._record(name, writer.num_bytes, writer.digest.hexdigest())

    def adopt(self, paths: Iterable[Path]) -> None:
        """Seal files a library wrote into the directory (fsync'ed and hashed from the page cache)."""
        paths = list(paths)
        with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
            sealed = list(pool.map(lambda p: file_digest(p, sync=True), paths))
        for path, (size, digest) in zip(paths, sealed, strict=True):
            self._record(str(Path(path).relative_to(self.directory)), size, digest)

    def _record(self, name: str, size: int, digest: str) -> None:
        with self._lock:
            self.digests[name] = {"bytes": size, DIGEST: digest}

    def finish(self) -> None:
        """Leave this rank's digests for rank 0's manifest."""
        target = self.directory / f"{DIGESTS_PREFIX}{self.rank}.json"
        with self._lock:
            text = json.dumps(self.digests)
        target.write_text(text)


def merge_digests(directory: Path) -> dict[str, dict[str, Any]]:
    """Every file of the directory with its bytes and digest: the ranks' digests, plus any file none declared."""
    files: dict[str, dict[str, Any]] = {}
    for digest_file in sorted(directory.glob(f"{DIGESTS_PREFIX}*.json")):
        files.update(json.loads(digest_file.read_text()))
        digest_file.unlink()
    for path in sorted(directory.rglob("*")):
        name = str(path.relative_to(directory))
        if path.is_file() and name != MARKER and name not in files:
            size, digest = file_digest(path)
            files[name] = {"bytes": size, DIGEST: digest}
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


def _recorded(entry: dict[str, Any]) -> tuple[str, str] | None:
    """(kind, hex) of the digest a manifest entry recorded; None for one written before content hashes."""
    kind = next((k for k in DIGEST_NAMES if k in entry), None)
    return None if kind is None else (kind, entry[kind])


def content_problem(path: Path) -> str | None:
    """Why a checkpoint's contents differ from its manifest (every file is read and hashed), or None.

    The files are hashed in parallel threads (the largest first), each with reads ahead of its hashing.
    """
    problem = size_problem(path)
    if problem is not None:
        return problem
    entries = read_manifest(path)["files"].items()
    hashed = {name: digest for name, entry in entries if (digest := _recorded(entry)) is not None}
    order = sorted(hashed, key=lambda name: os.path.getsize(Path(path) / name), reverse=True)

    def digest_of(name: str) -> str:
        return file_digest(Path(path) / name, kind=hashed[name][0])[1]

    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        found = dict(zip(order, pool.map(digest_of, order), strict=True))
    for name, (kind, expected) in hashed.items():
        if found[name] != expected:
            return (
                f"file {name} does not match the {DIGEST_NAMES[kind]} its manifest recorded (changed on disk)"
            )
    return None


def verify_while(
    path: Path,
    action: Callable[[], None],
    *,
    verify: bool = True,
    errors: tuple[type[BaseException], ...] = (Exception,),
) -> tuple[str | None, BaseException | None]:
    """Run `action` (loading the checkpoint at `path`) while its files are re-read and compared in other threads.

    Both read the same files, so the disk is read about once (the page cache serves the second
    reader) and the verification costs little more than the load. Returns (why the contents differ
    from the manifest or None, the exception of `errors` that `action` raised or None): a caller
    that finds a problem throws away what `action` loaded.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        checked = pool.submit(content_problem, path) if verify else None
        error = None
        try:
            action()
        except errors as err:
            error = err
        return (checked.result() if checked is not None else None), error


def total_bytes(path: Path) -> int:
    """Bytes of a complete checkpoint, from its manifest (0 when unreadable)."""
    try:
        return sum(entry["bytes"] for entry in read_manifest(path)["files"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return 0
