"""Rules of a data mixture (`data.sources`): weights, names, what it replaces, and each source's own data rules.

Each source is checked by the single-source data rules (options, files, a sample of records) on
its resolved settings, with their keys and messages spelled as the entry's (`data.sources[1].path`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

from launcher.components.data.mixture import NAME_PATTERN, SOURCE_KEYS, resolve
from launcher.config.data import DATA_KINDS
from launcher.rules import data, records
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, choice
from launcher.spec import RunSpec, SpecError

_DATA_KEY = re.compile(r"\bdata\.(" + "|".join(SOURCE_KEYS) + r")\b")


def _shape(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    d = spec.data
    if not d.sources:
        return
    if d.path is not None:
        yield SpecError(
            ("data.sources", "data.path"),
            "data.sources replaces data.path (a mixture of one source is a list of one). Move the path into an "
            f"entry, e.g. data.sources=[{{path:{d.path},weight:1}}], or drop data.sources.",
        )
    if d.val_path is not None:
        yield SpecError(
            ("data.sources", "data.val_path"),
            "each source of a mixture holds out its own records: give the entry a val_path "
            "(data.sources=[{path:a.jsonl,val_path:a_val.jsonl}, ...]) and drop data.val_path.",
        )
    if not d.packing:
        yield SpecError(
            ("data.sources", "data.packing"),
            "a mixture interleaves packed sequences of data.seq_len tokens; drop data.packing=false.",
        )
    names: dict[str, int] = {}
    for i, (entry, source) in enumerate(zip(d.sources, resolve(d), strict=True)):
        if not (math.isfinite(entry.weight) and entry.weight > 0):
            yield SpecError(
                (f"data.sources[{i}].weight",),
                f"must be a positive, finite number (a relative share of the draws), got {entry.weight}.",
            )
        if not NAME_PATTERN.match(source.name):
            yield SpecError(
                (f"data.sources[{i}].name",),
                f"the source name '{source.name}' may hold only letters, digits, '_', '.' and '-' (it becomes "
                f"part of the metrics keys). Set data.sources[{i}].name.",
            )
        if source.name in names:
            yield SpecError(
                (f"data.sources[{names[source.name]}].name", f"data.sources[{i}].name"),
                f"two sources are named '{source.name}'; names must differ (they key the per-source eval loss "
                "and the data position). Give one a `name`.",
            )
        names.setdefault(source.name, i)
        yield from choice(f"data.sources[{i}].kind", source.data.kind, DATA_KINDS, "data kind")
        if source.data.kind != "stdlib" and not source.data.path:
            yield SpecError(
                (f"data.sources[{i}].path",), "each source needs a path (a file, glob or directory)."
            )


def _as_entry(error: SpecError, index: int) -> SpecError | None:
    """A single-source data rule's error spelled for entry `index`; None when it is not about the entry."""
    if not any(_DATA_KEY.fullmatch(key) for key in error.keys):
        return None  # a data-group setting the mixture shares, reported once by the data rules
    spelled = _DATA_KEY.sub(lambda m: f"data.sources[{index}].{m.group(1)}", ", ".join(error.keys))
    message = _DATA_KEY.sub(lambda m: f"data.sources[{index}].{m.group(1)}", error.message)
    return SpecError(tuple(spelled.split(", ")), message)


def _each_source(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    sources = resolve(spec.data)
    rules = (data._options, data._files, records._sample)
    for i, source in enumerate(sources):
        if source.data.kind not in DATA_KINDS or (source.data.kind != "stdlib" and not source.data.path):
            continue  # _shape names it
        single = dataclasses.replace(spec, data=source.data)
        for rule in rules:
            for error in rule(single, hw):
                spelled = _as_entry(error, i)
                if spelled is not None:
                    yield spelled


RULES: tuple[Rule, ...] = (_shape, _each_source)
"""This module's rules, in the order they report."""
