"""Folders written by `datasets`' `save_to_disk`: a Dataset (state.json, dataset_info.json, data-*.arrow) or a
DatasetDict (dataset_dict.json and one such folder per split).

Their dataset_info.json is `datasets`' own metadata, not LLaMA-Factory's registry of the same name:
state.json (or dataset_dict.json) tells them apart. A DatasetDict trains on its `train` split (or its
only split); a folder of several splits and no `train` is refused naming them, since the split's own
folder (`data.path=DIR/SPLIT`) chooses one. Records are read with `datasets.load_from_disk`; the checks
before launch read the first records of the Arrow files directly (no `datasets` import).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STATE = "state.json"
"""A saved Dataset's file list and format."""
DICT = "dataset_dict.json"
"""A saved DatasetDict's split names."""


def saved_folder(pattern: str | None) -> Path | None:
    """The folder `pattern` names when `save_to_disk` wrote it (a Dataset or a DatasetDict); None otherwise."""
    if not pattern:
        return None
    folder = Path(pattern)
    if folder.is_dir() and ((folder / STATE).is_file() or (folder / DICT).is_file()):
        return folder
    return None


def _splits(folder: Path) -> list[str]:
    try:
        splits = json.loads((folder / DICT).read_text(encoding="utf-8")).get("splits", [])
    except (OSError, ValueError, AttributeError):
        splits = []
    return [s for s in splits if isinstance(s, str) and (folder / s / STATE).is_file()]


def split_folder(folder: Path, key: str = "data.path") -> Path:
    """The Dataset folder to train on: `folder` itself, or a DatasetDict's train (or only) split.

    Raises FileNotFoundError naming the splits when the choice is not clear.
    """
    if (folder / STATE).is_file():
        return folder
    splits = _splits(folder)
    if "train" in splits:
        return folder / "train"
    if len(splits) == 1:
        return folder / splits[0]
    listed = ", ".join(splits) or "none readable"
    choices = " or ".join(f"{key}={folder / s}" for s in splits[:3])
    raise FileNotFoundError(
        f"{key}: '{folder}' is a `datasets` DatasetDict (save_to_disk) with the splits {listed} and no `train` "
        f"split, so which one to train on is not clear. Name the split's folder: {choices or f'{key}=DIR/SPLIT'}."
    )


def arrow_files(folder: Path, key: str = "data.path") -> list[tuple[str, Path]]:
    """(split/file name, path) of the Arrow files of the split a saved folder trains on, in their order."""
    split = split_folder(folder, key)
    try:
        state = json.loads((split / STATE).read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FileNotFoundError(
            f"{key}: '{split / STATE}' does not list the dataset's Arrow files ({type(err).__name__}: {err}); "
            "write the folder again with `save_to_disk`."
        ) from None
    missing = [name for name in names if not (split / name).is_file()]
    if missing or not names:
        raise FileNotFoundError(
            f"{key}: '{split}' lists Arrow files that are not there ({', '.join(missing) or 'none listed'}); "
            "write the folder again with `save_to_disk`."
        )
    prefix = "" if split == folder else f"{split.name}/"
    return [(f"{prefix}{name}", split / name) for name in names]


def sample_arrow(path: Path, limit: int) -> Iterator[tuple[int, Any]]:
    """(row index, record) of the first `limit` rows of one Arrow file of a saved dataset."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:  # save_to_disk writes Arrow's stream format
        index = 0
        for batch in pa.ipc.open_stream(source):
            for row in batch.to_pylist():
                if index >= limit:
                    return
                yield index, row
                index += 1


def records(folder: Path, key: str = "data.path") -> Iterator[tuple[str, Any]]:
    """(stable key, record) of every row of the split a saved folder trains on, through `datasets.load_from_disk`."""
    import datasets

    datasets.disable_progress_bars()
    split = split_folder(folder, key)
    prefix = "" if split == folder else f"{split.name}/"
    for index, record in enumerate(datasets.load_from_disk(str(split))):
        yield f"{prefix}{index}", record
