"""Planting payloads: pickles whose loading would write a marker file, put where the launcher reads files.

`Payload(marker)` pickles as `os.system("touch MARKER")` (or `builtins.exec` writing it): plain
`pickle.load` runs it, and the tests check that no reader of the launcher does. `replant` keeps a
checkpoint's COMPLETE manifest matching the changed file, as whoever changed it could.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import pickle
from pathlib import Path

import torch


class Payload:
    """An object whose unpickling writes `marker`: by os.system (shell) or builtins.exec (Python)."""

    def __init__(self, marker: Path, how: str = "system") -> None:
        self.marker, self.how = Path(marker), how

    def __reduce__(self) -> tuple:
        if self.how == "system":
            return (os.system, (f"touch {self.marker}",))
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def replant(step_dir: Path, name: str, data: bytes) -> Path:
    """Write `data` as `step_dir/name` and update COMPLETE's bytes and SHA-256 for it; the file's path."""
    path = Path(step_dir) / name
    path.write_bytes(data)
    manifest_path = Path(step_dir) / "COMPLETE"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest, indent=1))
    return path


def poisoned_metadata(dcp_dir: Path, marker: Path) -> bytes:
    """The DCP metadata of `dcp_dir` as torch pickles it, with a payload inside (StorageMeta.modules)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(dcp_dir).read_metadata()
    metadata.storage_meta.modules = [Payload(marker)]
    return pickle.dumps(metadata)


def poisoned_torch_file(path: Path, marker: Path) -> bytes:
    """What torch.save writes for the file at `path`, with a payload added beside its content."""
    original = torch.load(
        path, map_location="cpu", weights_only=False
    )  # our own, just written: DeepSpeed records too
    state = {"content": original, "extra": Payload(marker, "exec")}
    target = Path(str(path) + ".new")
    torch.save(state, target)
    data = target.read_bytes()
    target.unlink()
    return data
