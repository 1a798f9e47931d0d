"""Reading torch.distributed.checkpoint (DCP) folders without running code from them.

torch's FileSystemReader reads `.metadata` with plain `pickle.load`, and its default planners read
non-tensor values (an optimizer's param_groups) with `torch.load(weights_only=False)`: a replaced
file would run whatever it names. `SafeReader` is the reader every DCP load of the launcher uses:

- `.metadata` goes through `MetadataUnpickler`, which admits only the globals in `ADMITTED` (what
  torch's own metadata pickles name: found by recording `find_class` over the fsdp, tp and pipeline
  checkpoints the launcher writes), then its structure is checked (types, plain file names in
  the folder, offsets);
- every non-tensor value is read with the weights-only reader and re-encoded before the planner
  sees it (tensors torch already reads weights-only).

Anything else is refused with launcher.components.files.safe_load.RefusedFile naming the file.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from launcher.components.files.safe_load import RefusedFile, load_tensor_file, refusal_in

_METADATA = "torch.distributed.checkpoint.metadata"
ADMITTED: dict[tuple[str, str], Callable[..., Any] | type] = {
    (_METADATA, "Metadata"): dcp_metadata.Metadata,
    (_METADATA, "TensorStorageMetadata"): dcp_metadata.TensorStorageMetadata,
    (_METADATA, "BytesStorageMetadata"): dcp_metadata.BytesStorageMetadata,
    (_METADATA, "ChunkStorageMetadata"): dcp_metadata.ChunkStorageMetadata,
    (_METADATA, "TensorProperties"): dcp_metadata.TensorProperties,
    (_METADATA, "MetadataIndex"): dcp_metadata.MetadataIndex,
    (_METADATA, "StorageMeta"): dcp_metadata.StorageMeta,
    (_METADATA, "_MEM_FORMAT_ENCODING"): dcp_metadata._MEM_FORMAT_ENCODING,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib._local", "PosixPath"): pathlib.PosixPath,  # where Python 3.13 and later pickle it from
    ("pathlib._local", "PurePosixPath"): pathlib.PurePosixPath,
}
"""Every global a DCP `.metadata` may name, with what it resolves to (never an import by name).

The metadata dataclasses and their memory-format enum (data only; TensorProperties' __setstate__
decodes that enum), the storage address of each item (_StorageInfo), torch.Size (offsets and
shapes), torch's layout lookup by name (`_get_layout('torch.strided')`: a dictionary lookup) and
the path StorageMeta records the save's folder as. torch dtypes are admitted by type (below).
Containers and scalars need no global (pickle opcodes build them); nothing that imports, calls
arbitrary functions or reads files is on the list."""

_SHARD_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MetadataUnpickler(pickle.Unpickler):
    """A pickle reader that resolves only the globals in ADMITTED and torch's dtypes; anything else is refused."""

    def __init__(self, file: io.BufferedIOBase, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        """The admitted object for (module, name), or RefusedFile."""
        found = ADMITTED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise RefusedFile(self.path, f"it names {module}.{name}", names_code=True)

    def persistent_load(self, pid: Any) -> Any:
        """DCP metadata has no persistent ids: refused."""
        raise RefusedFile(self.path, "it holds a persistent id", names_code=True)


def read_metadata(path: Path, folder: Path | None = None) -> dcp_metadata.Metadata:
    """The DCP metadata in file `path` (in `folder`, default its parent), read by MetadataUnpickler and checked."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            metadata = MetadataUnpickler(handle, path).load()
    except RefusedFile:
        raise
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
    ) as err:
        raise RefusedFile(
            path, f"not a DCP metadata pickle: {type(err).__name__}: {err}", names_code=False
        ) from None
    problem = _structure_problem(metadata, Path(folder) if folder else path.parent)
    if problem:
        raise RefusedFile(path, problem, names_code=False)
    return metadata


def _structure_problem(metadata: object, folder: Path) -> str | None:
    """Why `metadata` is not what torch writes (wrong types, a shard outside `folder`), or None."""
    if not isinstance(metadata, dcp_metadata.Metadata):
        return f"it holds a {type(metadata).__name__}, not torch's checkpoint Metadata"
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict) or not all(
        isinstance(k, str)
        and isinstance(v, (dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata))
        for k, v in entries.items()
    ):
        return "its state_dict_metadata is not a mapping of names to tensor or bytes entries"
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return "its storage_data is not a mapping"
    for index, info in storage.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(
            info, dcp_filesystem._StorageInfo
        ):
            return "its storage_data holds entries other than (MetadataIndex, _StorageInfo)"
        name = info.relative_path
        if not isinstance(name, str) or not _SHARD_NAME.fullmatch(name) or name.startswith("."):
            return f"it points at {name!r}, which is not a plain file name in {folder}"
        if not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (info.offset, info.length)
        ):
            return f"an entry of {name} has an offset or length that is not a non-negative integer"
    return None


class _WeightsOnlyBytes:
    """A planner whose `load_bytes` receives values read weights-only and re-encoded; everything else is the planner's."""

    def __init__(self, planner: LoadPlanner, reader: SafeReader) -> None:
        self._planner, self._reader = planner, reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Read `value` weights-only (refused: RefusedFile naming its shard file), then hand the planner a clean copy."""
        shard = Path(self._reader.path) / self._reader.storage_data[read_item.storage_index].relative_path
        data = load_tensor_file(value, name=shard)
        clean = io.BytesIO()
        torch.save(data, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)


class _Refused(BaseException):
    """Carries a RefusedFile through DCP's load, whose `except Exception` would otherwise read a rank's own
    metadata file instead and keep only the refusal's text; DCP wraps it whole into its CheckpointException."""


class SafeReader(FileSystemReader):
    """torch's FileSystemReader with `.metadata` read by MetadataUnpickler and non-tensor values read weights-only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        """The checked metadata (this rank's own file when DCP asks by rank), stamped with this load's id."""
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            metadata = read_metadata(path, Path(self.path))
        except RefusedFile as err:
            raise _Refused(err) from err
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        """torch's reads, with every non-tensor value passing the weights-only reader first."""
        return super().read_data(plan, _WeightsOnlyBytes(planner, self))  # type: ignore[arg-type]


def load_full_state(folder: Path, prefix: str | None = None) -> dict[str, Any]:
    """The whole state a DCP folder holds, in this process without a process group (only `prefix`'s top key if given)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    planner = _EmptyStateDictLoadPlanner(keys={prefix} if prefix else None)
    try:
        _load_state_dict(state, storage_reader=SafeReader(folder), planner=planner, no_dist=True)
    except CheckpointException as err:  # DCP wraps what its steps raise: a refusal comes out as itself
        raise refusal_in(err) or err from None
    return state
