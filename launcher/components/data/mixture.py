"""A mixture's sources resolved: each `data.sources` entry as a name, a weight and a single-source DataConfig.

Every source is tokenized and cached exactly as a single `data.path` would be (its own cache key,
which holds no weight), so changing one source's weight, or adding a source, re-tokenizes nothing.
An entry's unset settings come from the data group's (`data.format`, `data.field`, ...); its kind,
when neither it nor the data group names one, follows its path: jsonl for .jsonl, files otherwise.
Pure: no torch, so the launching process and the rules read it cheaply.
"""

from __future__ import annotations

import dataclasses
import glob
import re
from dataclasses import dataclass
from pathlib import PurePath

from launcher.config.data import DataConfig, SourceConfig

SOURCE_KEYS = ("path", "kind", "format", "field", "template", "train_on", "val_path")
"""Entry keys that stand for the data key of the same name in the source's own DataConfig."""
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")
"""What a source name may hold: it becomes part of metrics keys (`eval_loss/<name>`) and checkpoint state."""


@dataclass(frozen=True, kw_only=True)
class Source:
    """One resolved source of a mixture."""

    name: str
    """Its name in metrics and checkpoints."""
    weight: float
    """Its share of the draws, normalized over the sources."""
    data: DataConfig
    """The single-source data settings it is read, tokenized and cached with."""


def default_name(entry: SourceConfig, kind: str) -> str:
    """The file stem of the entry's path (a glob's last plain folder), or `stdlib`."""
    if kind == "stdlib" or not entry.path:
        return "stdlib"
    parts = [part for part in PurePath(entry.path).parts if not glob.has_magic(part)]
    tail = PurePath(entry.path).name
    return PurePath(tail).stem if not glob.has_magic(tail) else (parts[-1] if parts else "source")


def source_kind(entry: SourceConfig, data: DataConfig) -> str:
    """The entry's kind, else data.kind, else (data.kind at its default, stdlib) jsonl or files by suffix."""
    if entry.kind is not None:
        return entry.kind
    if data.kind != "stdlib":
        return data.kind
    return "jsonl" if (entry.path or "").endswith(".jsonl") else "files"


def source_data(entry: SourceConfig, data: DataConfig) -> DataConfig:
    """The entry as a single-source DataConfig: its own settings over the data group's."""
    kind = source_kind(entry, data)
    own = {key: getattr(entry, key) for key in SOURCE_KEYS if getattr(entry, key) is not None}
    return dataclasses.replace(data, **{**own, "kind": kind, "val_path": entry.val_path, "sources": ()})


def resolve(data: DataConfig) -> list[Source]:
    """The sources of a mixture in their order (empty when data.sources is)."""
    return [
        Source(
            name=entry.name or default_name(entry, source_kind(entry, data)),
            weight=float(entry.weight),
            data=source_data(entry, data),
        )
        for entry in data.sources
    ]


def single_configs(data: DataConfig) -> list[DataConfig]:
    """What is tokenized: each source's DataConfig for a mixture, else the data group itself."""
    return [source.data for source in resolve(data)] if data.sources else [data]


def describe(data: DataConfig) -> str:
    """One line naming the sources and their normalized weights, for logs and the dry run."""
    sources = resolve(data)
    total = sum(source.weight for source in sources) or 1.0
    parts = [f"{s.name} {s.weight / total:.0%} ({s.data.kind}: {s.data.path or 'stdlib'})" for s in sources]
    return f"mixture of {len(sources)}: {', '.join(parts)} (seq_len {data.seq_len})"
