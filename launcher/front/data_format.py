"""Resolve `data.format=auto` from the first record, before the rules run and spec.yaml is written.

spec.yaml then holds the chosen format (and field), so a rank, the token cache key and a rerun of
the run directory all see one concrete layout; `announce` says what was chosen and why. It never
guesses: a record that fits two layouts is refused naming both, and preference pairs (or kto
examples) under the supervised objective are refused with the objective that reads them.
"""

from __future__ import annotations

from omegaconf import DictConfig

from launcher.components.data.formats import DEFAULT_FIELDS, PAIR_FIX
from launcher.components.data.layouts import choices, find_registry, matches, reason, whole_conversations
from launcher.components.data.saved import saved_folder
from launcher.components.data.sources import BUILDERS, RecordError, matching_files, sample_records
from launcher.config.data import DataConfig
from launcher.front.config_values import typed, with_values
from launcher.spec import RunSpec, SpecError

FORMAT_KEYS = ("data.format", "data.field")


def _first_record(d: DataConfig) -> tuple[str, object] | None:
    """(where, record) of the first record of data.path; None when there is none to read (the rules say why)."""
    if d.kind != "files" and saved_folder(d.path):
        return None  # a save_to_disk folder is read by data=files only
    try:
        files = [p for _, p in matching_files(d.path, suffixes=tuple(BUILDERS) if d.kind == "files" else ())]
    except FileNotFoundError:
        return None
    if find_registry(files) is not None:
        return None
    for path in files:
        try:
            for where, record in sample_records(path, 1, jsonl=d.kind == "jsonl"):
                return where, record
        except RecordError:
            return None  # the record check reports the unreadable file
    return None


def choose(d: DataConfig) -> tuple[str, str] | SpecError | None:
    """(format, field) for data.format=auto, a SpecError when no layout or several fit, or None when there is no
    record to read."""
    if d.kind in ("stdlib", "text"):
        return "text", d.field
    first = _first_record(d)
    if first is None:
        return None
    where, record = first
    found = matches(record, None if d.field == "text" else d.field)
    if len(found) == 1:
        return found[0]
    if found:
        return SpecError(
            FORMAT_KEYS,
            f"data.format=auto will not guess: {where} fits {len(found)} layouts. Set {choices(found)}.",
        )
    fields = ", ".join(sorted(map(str, record))) if isinstance(record, dict) else type(record).__name__
    return SpecError(
        FORMAT_KEYS,
        f"data.format=auto recognizes no layout in {where} (its fields: {fields}). It knows text (a 'text' "
        "string), instruction ('instruction' and 'output'), chat ('messages' of role/content), sharegpt "
        "('conversations' of from/value), pretokenized ('input_ids'), preference ('chosen' and 'rejected') and "
        "kto ('completion' and a true/false 'label'). Set data.format (and data.field) to the record's layout.",
    )


def _pairs_under_sft(cfg: DictConfig, fmt: str, d: DataConfig) -> SpecError | None:
    """The refusal for preference pairs (or kto examples) that the supervised objective would train as text."""
    objective = typed(cfg, "objective")
    if fmt not in ("preference", "kto") or (objective is not None and objective.name != "sft"):
        return None
    first = _first_record(d)  # read again only here, on the way to a refusal
    whole = whole_conversations(first[1]) if first and isinstance(first[1], dict) else []
    sft = (
        f" To fine-tune on the whole conversations the records also hold, set {choices(whole)}."
        if whole
        else ""
    )
    return SpecError(
        ("data.format", "objective.name"),
        f"data.format=auto found {fmt} data in {d.path}: {reason(fmt, DEFAULT_FIELDS[fmt])}, but objective=sft "
        f"trains one text per record and would drop a side. To {PAIR_FIX}.{sft}",
    )


def fill_format(cfg: DictConfig) -> tuple[DictConfig, list[SpecError]]:
    """The config with data.format=auto replaced by the detected format and field; or why it cannot be."""
    d = typed(cfg, "data")
    if d is None or d.format != "auto":
        return cfg, []
    chosen = choose(d)
    if chosen is None:
        return cfg, []
    if isinstance(chosen, SpecError):
        return cfg, [chosen]
    fmt, field = chosen
    refusal = _pairs_under_sft(cfg, fmt, d)
    if refusal is not None:
        return cfg, [refusal]
    field = "text" if field == DEFAULT_FIELDS[fmt] else field  # left at `text`: the format's usual field
    return with_values(cfg, {"data.format": fmt, "data.field": field}), []


def announce(spec: RunSpec) -> str:
    """The line printed before launch (and in the dry run) when data.format=auto chose the format."""
    from launcher.components.data.formats import field_of

    d = spec.data
    field = field_of(d)
    extra = "" if d.field == "text" else f" data.field={d.field}"
    return f"data.format=auto: data.format={d.format}{extra}, since {reason(d.format, field)}"
