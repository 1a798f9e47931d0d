"""Which layout a data file holds: the record format `data.format=auto` picks, and dataset registries that are not data.

`detect` looks at one record's fields (no tokenizer, no `datasets`); `registry_problem` names a
LLaMA-Factory `dataset_info.json` (a registry of datasets, not records) and the data files it lists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REGISTRY_NAME = "dataset_info.json"
"""LLaMA-Factory's dataset registry: dataset name -> {file_name, formatting, columns}."""
REGISTRY_FORMATS = {"alpaca": "instruction", "sharegpt": "sharegpt"}
"""A registry entry's `formatting` -> our data.format."""
REASONS = {
    "text": "'{field}' holds text",
    "instruction": "the records have instruction/output (the alpaca layout)",
    "chat": "'{field}' holds {{role, content}} messages",
    "sharegpt": "'{field}' holds ShareGPT {{from, value}} turns",
    "pretokenized": "'{field}' holds token ids",
}
"""Why `detect` chose a format, for the line printed before launch."""


def _turns_layout(value: Any) -> str | None:
    """chat or sharegpt for a list of turns keyed role/content or from/value; None otherwise."""
    if not isinstance(value, list) or not value or not isinstance(value[0], dict):
        return None
    if "role" in value[0]:
        return "chat"
    if "from" in value[0]:
        return "sharegpt"
    return None


def _value_layout(value: Any) -> str | None:
    """The format a field's value suggests: text, token ids, or a conversation."""
    if isinstance(value, str):
        return "text"
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return "pretokenized"
    return _turns_layout(value)


def detect(record: Any, field: str | None = None) -> tuple[str, str] | None:
    """(format, field) that a record's layout suggests, or None; `field`: look only at that field."""
    if not isinstance(record, dict):
        return None
    if field is not None:
        layout = _value_layout(record.get(field))
        return (layout, field) if layout else None
    for name in ("messages", "conversations"):
        layout = _turns_layout(record.get(name))
        if layout:
            return layout, name
    if {"instruction", "output"} <= record.keys():
        return "instruction", "instruction"
    if _value_layout(record.get("input_ids")) == "pretokenized":
        return "pretokenized", "input_ids"
    if isinstance(record.get("text"), str):
        return "text", "text"
    return None


def reason(fmt: str, field: str) -> str:
    """Why `detect` chose `fmt`, in words."""
    return REASONS[fmt].format(field=field)


def find_registry(paths: list[Path]) -> Path | None:
    """The first dataset_info.json among `paths`, or None."""
    return next((p for p in paths if p.name == REGISTRY_NAME), None)


def _entries(path: Path) -> list[str]:
    """`name -> file (format)` of each entry of a registry, as far as it can be read."""
    try:
        registry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return []
    if not isinstance(registry, dict):
        return []
    found = []
    for name, entry in registry.items():
        if not isinstance(entry, dict):
            continue
        if isinstance(entry.get("file_name"), str):
            fmt = REGISTRY_FORMATS.get(entry.get("formatting", "alpaca"), "chat")
            found.append(f"{name} -> {path.parent / entry['file_name']} (data.format={fmt})")
        else:
            source = (
                entry.get("hf_hub_url") or entry.get("ms_hub_url") or entry.get("script_url") or "elsewhere"
            )
            found.append(f"{name} -> {source} (not a local file)")
    return found


def registry_problem(path: Path, key: str = "data.path") -> str:
    """Why a dataset_info.json under `key` cannot be trained on, and the data files it lists instead."""
    entries = _entries(path)
    listed = "; ".join(entries[:6]) + (f"; and {len(entries) - 6} more" if len(entries) > 6 else "")
    lists = f" It lists: {listed}." if entries else ""
    return (
        f"{path} is a dataset registry (LLaMA-Factory's {REGISTRY_NAME}), not training records.{lists} "
        f"Point {key} at the data file it lists (one file, or a folder without the registry), with that file's "
        "data.format."
    )
