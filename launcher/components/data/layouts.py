"""Which layout a data file holds: the record format `data.format=auto` picks, and dataset registries that are not data.

`matches` lists every layout one record's fields fit (no tokenizer, no `datasets`); `detect` is the
one layout when exactly one fits, so that a record fitting two is never guessed (data.format=auto
refuses it naming both). A preference pair (chosen and rejected) or a kto example (completion and a
true/false label) is that layout alone: its conversation or prompt is part of it, not a chat to
train on. `registry_problem` names a LLaMA-Factory `dataset_info.json` (a registry of datasets, not
records) and the data files it lists.
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
    "preference": "the records hold preference pairs (chosen and rejected)",
    "kto": "the records hold kto examples (a completion and a true/false label)",
}
"""Why `detect` chose a format, for the line printed before launch."""
RESPONSE_ROLES = frozenset({"assistant", "gpt", "chatgpt", "function_call"})
"""Roles (chat) and `from` values (ShareGPT) of a turn that answers."""
DEFAULT_FIELDS = {
    "text": "text",
    "chat": "messages",
    "sharegpt": "conversations",
    "pretokenized": "input_ids",
    "instruction": "instruction",
    "preference": "chosen",
    "kto": "completion",
}
"""The field each format reads when data.field is left at `text` (preference and kto read their own fields)."""


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


def _pair_layout(record: dict) -> tuple[str, str] | None:
    """(preference, chosen) for a record with chosen and rejected; (kto, completion) for completion + bool label."""
    if "chosen" in record and "rejected" in record:
        return "preference", "chosen"
    if "completion" in record and isinstance(record.get("label"), bool):
        return "kto", "completion"
    return None


def whole_conversations(record: dict) -> list[tuple[str, str]]:
    """(format, field) of conversations a record holds that end in a response: UltraFeedback's `messages` beside
    its pair can be fine-tuned on, LLaMA-Factory's `conversations` (the pair's shared prompt) cannot."""
    found = []
    for name in ("messages", "conversations"):
        layout, turns = _turns_layout(record.get(name)), record.get(name)
        last = turns[-1] if layout else None
        if isinstance(last, dict) and last.get("role", last.get("from")) in RESPONSE_ROLES:
            found.append((layout, name))
    return found


def matches(record: Any, field: str | None = None) -> list[tuple[str, str]]:
    """Every (format, field) whose layout a record fits; `field`: look only at that field."""
    if not isinstance(record, dict):
        return []
    if field is not None:
        layout = _value_layout(record.get(field))
        return [(layout, field)] if layout else []
    pair = _pair_layout(record)
    if pair is not None:
        return [pair]
    found = [
        (layout, name)
        for name in ("messages", "conversations")
        if (layout := _turns_layout(record.get(name)))
    ]
    if {"instruction", "output"} <= record.keys():
        found.append(("instruction", "instruction"))
    if _value_layout(record.get("input_ids")) == "pretokenized":
        found.append(("pretokenized", "input_ids"))
    if isinstance(record.get("text"), str):
        found.append(("text", "text"))
    return found


def detect(record: Any, field: str | None = None) -> tuple[str, str] | None:
    """(format, field) when a record fits exactly one layout, else None (none, or several: see `matches`)."""
    found = matches(record, field)
    return found[0] if len(found) == 1 else None


def choices(found: list[tuple[str, str]]) -> str:
    """The settings that read each of several layouts, for a message that asks the user to choose."""
    return " or ".join(
        f"data.format={fmt}"
        + ("" if name in ("text", DEFAULT_FIELDS[fmt]) else f" data.field={name}")
        + f" ({reason(fmt, name)})"
        for fmt, name in found
    )


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
