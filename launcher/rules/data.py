"""Rules of the data group: sequence length against the model, the held-out share, options, files, batching."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator

from launcher.components.data.formats import INSTRUCTION_TEMPLATE, template_problem
from launcher.components.data.layouts import find_registry, registry_problem
from launcher.components.data.saved import saved_folder
from launcher.components.data.sources import BUILDERS, matching_files, suffix_of
from launcher.components.model.hf_files import local_dir
from launcher.config.data import BATCHING, FORMATS, TRAIN_ON, TRAIN_REASONING
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, choice, positive
from launcher.spec import RunSpec, SpecError


def _model_and_data(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    m, d = spec.model, spec.data
    if 0 < m.max_seq_len < d.seq_len and local_dir(m) is None:  # a folder's context: rules/hf_model.py
        yield SpecError(
            ("data.seq_len", "model.max_seq_len"),
            f"sequences of {d.seq_len} tokens exceed the model's context of {m.max_seq_len}. "
            f"Lower data.seq_len or raise model.max_seq_len.",
        )
    yield from positive("data.seq_len", d.seq_len)
    if not 0.0 < d.val_fraction < 1.0:
        yield SpecError(("data.val_fraction",), f"must lie strictly between 0 and 1, got {d.val_fraction}.")


def _options(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    d = spec.data
    yield from choice("data.format", d.format, FORMATS, "data format")
    yield from choice("data.train_on", d.train_on, TRAIN_ON, "data.train_on option")
    yield from choice(
        "data.train_reasoning", d.train_reasoning, TRAIN_REASONING, "data.train_reasoning option"
    )
    yield from positive("data.num_proc", d.num_proc)
    if d.num_workers < 0:
        yield SpecError(
            ("data.num_workers",), f"must be 0 (batches built in the loop) or more, got {d.num_workers}."
        )
    if d.kind in ("stdlib", "text") and d.format in FORMATS and d.format != "text":
        yield SpecError(
            ("data.format", "data.kind"),
            f"data.kind={d.kind} reads plain text, so only data.format=text applies (got {d.format}). Records in "
            "the instruction, chat, sharegpt or pretokenized layout come from `data=files` (or `data=jsonl`).",
        )
    if d.streaming and d.kind != "files":
        yield SpecError(
            ("data.streaming", "data.kind"),
            "data.streaming applies to `data=files` (read through `datasets`).",
        )
    if d.template is not None and d.format != "instruction":
        yield SpecError(
            ("data.template", "data.format"),
            "data.template renders instruction records: add data.format=instruction or drop it.",
        )
    if d.system_prompt_merge and d.format not in ("chat", "sharegpt"):
        yield SpecError(
            ("data.system_prompt_merge", "data.format"),
            f"data.system_prompt_merge folds a conversation's system turn into its first user turn; it applies to "
            f"data.format=chat and sharegpt, not {d.format}. Drop it or set the format.",
        )
    if d.train_reasoning != "auto" and d.format not in ("chat", "sharegpt", "preference", "kto"):
        yield SpecError(
            ("data.train_reasoning", "data.format"),
            f"data.train_reasoning decides whether a conversation's reasoning traces are trained; it applies to "
            f"data.format=chat, sharegpt, preference and kto, not {d.format}. Drop it or set the format.",
        )
    problem = template_problem(d.template)
    if problem:
        yield SpecError(("data.template",), f"{problem}. The default: {INSTRUCTION_TEMPLATE!r}.")
    if d.val_path is not None and d.kind == "stdlib":
        yield SpecError(
            ("data.val_path", "data.kind"),
            "data.kind=stdlib splits its own held-out share; drop data.val_path.",
        )


def _files(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    d = spec.data
    if d.kind not in ("text", "jsonl", "files"):
        return
    suffixes = tuple(BUILDERS) if d.kind == "files" else ()
    for key, pattern in (("data.path", d.path), ("data.val_path", d.val_path)):
        if pattern is None and key == "data.val_path":
            continue
        if d.kind != "files" and saved_folder(pattern) is not None:
            yield SpecError(
                (key, "data.kind"),
                f"'{pattern}' is a folder `datasets` wrote with save_to_disk (Arrow files, state.json), which "
                f"data.kind={d.kind} does not read. Use `data=files` (read with datasets.load_from_disk).",
            )
            continue
        try:
            found = matching_files(pattern, key=key, suffixes=suffixes)
        except FileNotFoundError as err:
            yield SpecError((key,), str(err))
            continue
        mixed = _mixed_kinds(pattern, found) if d.kind == "files" else None
        if mixed:
            yield SpecError((key,), mixed)
            continue
        registry = find_registry([path for _, path in found]) if d.kind != "text" else None
        if registry is not None:
            yield SpecError((key,), registry_problem(registry, key))
            continue
        if d.kind == "text" and all(path.stat().st_size == 0 for _, path in found):
            yield SpecError(
                (key,), f"every file {key} names is empty ({found[0][1]}{', ...' if len(found) > 1 else ''})."
            )


def _mixed_kinds(pattern: str, found: list) -> str | None:
    """Why a folder of data files of several kinds (.jsonl and .parquet, say) is refused; None when they are alike.

    Shards of one dataset share one kind; a folder of several is usually a dataset beside its
    conversions or exports, which `datasets` would read as one table and fail on (or mix) part way.
    """
    if not os.path.isdir(pattern) or saved_folder(pattern) is not None:
        return None
    counts = Counter(suffix_of(path) for _, path in found)
    if (
        len({BUILDERS.get(suffix) for suffix in counts}) < 2
    ):  # JSON Lines and JSON arrays, gzip'd or not: one kind
        return None
    kinds = ", ".join(f"{suffix} ({n} file{'s' if n > 1 else ''})" for suffix, n in sorted(counts.items()))
    first = sorted(counts)[0]
    return (
        f"the folder '{pattern}' holds data files of several kinds: {kinds}. The shards of one dataset share one "
        f"kind: point data.path at one kind with a glob (e.g. '{os.path.join(pattern, '**', '*' + first)}'), or "
        "move the others out of the folder."
    )


def _batching(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    d = spec.data
    yield from choice("data.batching", d.batching, BATCHING, "batching")
    if d.batching in ("group_by_length", "token_budget") and d.packing:
        yield SpecError(
            ("data.batching", "data.packing"),
            f"{d.batching} batches whole documents of different lengths, but packed sequences all hold "
            f"data.seq_len tokens. Add `data.packing=false`.",
        )
    if d.batching == "token_budget":
        if d.max_tokens_per_batch is None or d.max_tokens_per_batch < d.seq_len:
            yield SpecError(
                ("data.max_tokens_per_batch", "data.seq_len"),
                f"token_budget needs a budget of at least one sequence (data.seq_len={d.seq_len}) of padded "
                f"tokens per micro batch, got {d.max_tokens_per_batch}. E.g. data.max_tokens_per_batch={16 * d.seq_len}.",
            )
    elif d.max_tokens_per_batch is not None:
        yield SpecError(
            ("data.max_tokens_per_batch", "data.batching"),
            "max_tokens_per_batch is used by token_budget batching only. Add `data.batching=token_budget "
            "data.packing=false`, or drop it.",
        )


RULES: tuple[Rule, ...] = (_model_and_data, _options, _files, _batching)
"""This module's rules, in the order they report."""
