"""Where records come from: the standard library, text files, JSON Lines, or dataset files through `datasets`.

Every source yields (stable key, record) pairs in a fixed order; the key decides the held-out
split (a hash of it), so the split never changes with file order, glob spelling or the number of
ranks. `sample_records` reads the first records of a file without `datasets` (fast), for the
checks that run before any rank starts; `records` reads everything, for tokenization.
"""

from __future__ import annotations

import codecs
import csv
import glob
import gzip
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from launcher.components.data import saved
from launcher.config.data import DataConfig

STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})
BUILDERS = {
    ".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json", ".parquet": "parquet",
    ".csv": "csv", ".txt": "text",
}  # fmt: skip
"""File suffix -> the `datasets` builder that reads it (data.kind=files; gzip is read by the json builder)."""
JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
"""What data.kind=jsonl reads: JSON Lines or a JSON array, gzip-compressed or not."""


class RecordError(ValueError):
    """A record that the format cannot use: names the file, the record and the key."""


def suffix_of(path: Path) -> str:
    """A data file's kind by name: `.jsonl.gz` and `.json.gz` whole, otherwise the last suffix."""
    name = path.name.lower()
    return next((s for s in (".jsonl.gz", ".json.gz") if name.endswith(s)), path.suffix)


def _open(path: Path) -> IO[bytes]:
    """The file's bytes, decompressed when its name ends in .gz."""
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else path.open("rb")


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of the standard library's .py files, tests and third-party code left out."""
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS and d != "__pycache__"]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def matching_files(
    pattern: str | None, *, key: str = "data.path", suffixes: tuple[str, ...] = ()
) -> list[tuple[str, Path]]:
    """(key, path) of the files a file, glob or directory names, sorted; keys are relative to their common folder.

    A directory stands for every file below it with one of `suffixes` (any file when empty); a folder
    `save_to_disk` wrote stands for the Arrow files of the split it trains on (launcher.components.data.saved).
    """
    if not pattern:
        raise FileNotFoundError(f"{key} is not set: set {key} to a file, a glob or a directory.")
    folder = saved.saved_folder(pattern)
    if folder is not None:
        return saved.arrow_files(folder, key)
    if os.path.isdir(pattern):
        found = [Path(p) for p in glob.glob(os.path.join(pattern, "**", "*"), recursive=True)]
        paths = sorted(p for p in found if p.is_file() and (not suffixes or suffix_of(p) in suffixes))
        if not paths:
            wanted = f" ending in {', '.join(suffixes)}" if suffixes else ""
            raise FileNotFoundError(f"{key}: the directory '{pattern}' holds no files{wanted}.")
    else:
        paths = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        if not paths:
            raise FileNotFoundError(
                f"{key}: no file matches '{pattern}'. Give an existing file, a glob that matches files, or a "
                "directory (relative paths start from the directory `train` runs in)."
            )
    base = Path(os.path.commonpath([p.parent.resolve() for p in paths]))
    return [(p.resolve().relative_to(base).as_posix(), p) for p in paths]


def read_text(path: Path, limit: int | None, *, strict: bool = False) -> str:
    """A file's text, at most `limit` bytes of it; bytes that are not UTF-8 survive a round trip (surrogateescape).

    `strict` (data.kind=text): a NUL byte (a binary file) or bytes that are not UTF-8 raise RecordError
    naming the byte offset and line; a character the limit cuts in two is dropped, not an error.
    """
    with path.open("rb") as f:
        data = f.read() if limit is None else f.read(limit)
        cut = limit is not None and len(data) == limit and bool(f.read(1))
    if not strict:
        return data.decode("utf-8", "surrogateescape")
    nul = data.find(b"\x00")
    if nul >= 0:
        line = data.count(b"\n", 0, nul) + 1
        raise RecordError(
            f"{path} holds a NUL byte at byte {nul:,} (line {line}): it is a binary file, "
            "not text, and data=text would train on its bytes. Leave it out of data.path (a glob such as "
            "'corpus/*.txt', or a folder of text files only)."
        )
    try:
        return codecs.getincrementaldecoder("utf-8")("strict").decode(data, final=not cut)
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise RecordError(
            f"{path} is not UTF-8 text: byte {err.start:,} (line {line}) is 0x{data[err.start]:02x} ({err.reason}). "
            "data=text reads UTF-8. Convert the file (e.g. `iconv -f latin1 -t utf-8 FILE > FILE.utf8`) or leave "
            "it out of data.path."
        ) from None


def _one_object_hint(path: Path) -> str:
    """What to do when a file that fails as JSON Lines is one (pretty-printed) JSON object; '' when it is not."""
    try:
        with _open(path) as f:
            value = json.loads(f.read())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return ""
    if not isinstance(value, dict):
        return ""
    keys = ", ".join(sorted(map(str, value))[:8])
    return (
        f" The file is one JSON object (keys: {keys}), not JSON Lines or a JSON array of records: write one "
        "record per line, or the records as one array [{...}, {...}]."
    )


def _jsonl(path: Path, limit: int | None = None) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line of a JSON Lines file (gzip-compressed or not)."""
    with _open(path) as f:
        count = 0
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                hint = _one_object_hint(path) if count == 0 else ""
                raise RecordError(f"{path}:{lineno}: not valid JSON ({err.msg}).{hint}") from err
            count += 1
            if limit is not None and count >= limit:
                return


def is_json_array(path: Path) -> bool:
    """Whether a file holds one JSON array (alpaca_data.json's layout) rather than JSON Lines."""
    with _open(path) as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"[")


def _json(path: Path, limit: int | None) -> Iterator[tuple[int, Any]]:
    """Records of a .json file: a JSON array of records, or JSON Lines under a .json name."""
    if not is_json_array(path):
        yield from _jsonl(path, limit)
        return
    try:
        with _open(path) as f:
            values = json.loads(f.read())
    except json.JSONDecodeError as err:
        raise RecordError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}).") from err
    yield from enumerate(values[:limit] if limit is not None else values)


def _csv(path: Path, limit: int | None) -> Iterator[tuple[int, Any]]:
    with path.open(newline="", encoding="utf-8") as f:
        for index, row in enumerate(csv.DictReader(f)):
            if limit is not None and index >= limit:
                return
            yield index, row


def _parquet(path: Path, limit: int | None) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=min(limit or 1024, 1024)):
        for row in batch.to_pylist():
            if limit is not None and index >= limit:
                return
            yield index, row
            index += 1


def sample_records(path: Path, limit: int, *, jsonl: bool = False) -> Iterator[tuple[str, Any]]:
    """(where, record) of the first `limit` records of a data file (`jsonl`: JSON Lines or a JSON array, whatever its name).

    Read without `datasets`, so it is fast. `where` names the record for a person: `file:line` for
    JSON Lines, `file record N` otherwise.
    """
    suffix = suffix_of(path)
    if jsonl:
        suffix = ".json" if is_json_array(path) else ".jsonl"
    if suffix == ".txt":
        yield f"{path}", {"text": read_text(path, None)}
        return
    readers = {
        ".jsonl": _jsonl, ".jsonl.gz": _jsonl, ".json": _json, ".json.gz": _json, ".csv": _csv,
        ".parquet": _parquet, ".arrow": saved.sample_arrow,
    }  # fmt: skip
    if suffix not in readers:
        raise RecordError(
            f"{path}: data.kind=files reads {', '.join(BUILDERS)} files; rename it or leave it out of data.path."
        )
    try:
        for index, record in readers[suffix](path, limit):
            yield (
                (f"{path}:{index}" if suffix in (".jsonl", ".jsonl.gz") else f"{path} record {index}"),
                record,
            )
    except RecordError:
        raise
    except Exception as err:  # pyarrow, csv and unicode errors name the file here
        raise RecordError(f"{path}: cannot be read as {suffix} ({type(err).__name__}: {err}).") from err


def _datasets_records(path: Path, cfg: DataConfig, cache_dir: Path) -> Iterator[tuple[int, Any]]:
    """Records of one file through `datasets` (streamed with data.streaming, else through its Arrow cache)."""
    import datasets

    datasets.disable_progress_bars()
    builder = BUILDERS.get(suffix_of(path))
    if builder is None:
        raise RecordError(f"{path}: data.kind=files reads {', '.join(BUILDERS)} files.")
    options: dict[str, Any] = {"sample_by": "document"} if builder == "text" else {}
    try:
        ds = datasets.load_dataset(
            builder, data_files=[str(path)], split="train", streaming=cfg.streaming,
            cache_dir=None if cfg.streaming else str(cache_dir / "datasets"), **options,
        )  # fmt: skip
        yield from enumerate(ds)
    except RecordError:
        raise
    except Exception as err:  # schema and parse errors of the builder
        raise RecordError(f"{path}: `datasets` cannot read it ({type(err).__name__}: {err}).") from err


def records(cfg: DataConfig, pattern: str | None, cache_dir: Path) -> Iterator[tuple[str, str, Any]]:
    """(split key, where, record) of every record the source holds, in a fixed order."""
    if cfg.kind == "stdlib":
        for key, path in stdlib_files():
            yield key, str(path), {"text": read_text(path, cfg.max_bytes)}
    elif cfg.kind == "text":
        for key, path in matching_files(pattern):
            yield key, str(path), {"text": read_text(path, cfg.max_bytes, strict=True)}
    elif cfg.kind == "jsonl":
        for key, path in matching_files(pattern, suffixes=JSONL_SUFFIXES):
            if is_json_array(path):  # the alpaca_data.json layout: one array of records
                for index, record in _json(path, None):
                    yield f"{key}:{index}", f"{path} record {index}", record
                continue
            for lineno, record in _jsonl(path):
                yield f"{key}:{lineno}", f"{path}:{lineno}", record
    elif cfg.kind == "files" and (folder := saved.saved_folder(pattern)) is not None:
        for key, record in saved.records(folder):  # save_to_disk's folder, through load_from_disk
            yield key, f"{folder} record {key}", record
    elif cfg.kind == "files":
        for key, path in matching_files(pattern, suffixes=tuple(BUILDERS)):
            for index, record in _datasets_records(path, cfg, cache_dir):
                yield f"{key}:{index}", f"{path} record {index}", record
    else:
        raise ValueError(f"unknown data.kind {cfg.kind!r}; known: stdlib, text, jsonl, files.")


def source_files(cfg: DataConfig) -> list[Path]:
    """The files a source reads (train and val), for the cache key."""
    if cfg.kind == "stdlib":
        return [path for _, path in stdlib_files()]
    suffixes = tuple(BUILDERS) if cfg.kind == "files" else ()
    found = [path for _, path in matching_files(cfg.path, suffixes=suffixes)]
    if cfg.val_path:
        found += [path for _, path in matching_files(cfg.val_path, key="data.val_path", suffixes=suffixes)]
    return found


def describe(cfg: DataConfig) -> str:
    """One line naming the data source and format, for logs and the dry run."""
    if cfg.kind == "stdlib":
        source = f"stdlib: Python standard library source in {stdlib_root()}"
    elif cfg.kind in ("jsonl", "files"):
        source = f"{cfg.kind}: {cfg.format} records of {cfg.path}"
    else:
        source = f"{cfg.kind}: {cfg.path}"
    held_out = f"held out: {cfg.val_path}" if cfg.val_path else f"{cfg.val_fraction:.0%} held out"
    cap = f", first {cfg.max_bytes:,} tokens" if cfg.max_bytes is not None else ""
    return f"{source} (seq_len {cfg.seq_len}, {held_out}{cap})"
