"""Rules of the data group: sequence length against the model, the held-out share, files, batching."""

from __future__ import annotations

import glob
from collections.abc import Iterator

from launcher.groups.batching import BATCHING
from launcher.groups.data import DataConfig
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, choice, positive
from launcher.spec import RunSpec, SpecError


def _model_and_data(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    m, d = spec.model, spec.data
    if d.seq_len > m.max_seq_len:
        yield SpecError(
            ("data.seq_len", "model.max_seq_len"),
            f"sequences of {d.seq_len} tokens exceed the model's context of {m.max_seq_len}. "
            f"Lower data.seq_len or raise model.max_seq_len.",
        )
    yield from positive("data.seq_len", d.seq_len)
    if m.n_head <= 0 or m.d_model % max(m.n_head, 1):
        yield SpecError(
            ("model.d_model", "model.n_head"),
            f"d_model ({m.d_model}) must be a positive multiple of n_head ({m.n_head}).",
        )
    if m.vocab_size < 256:
        yield SpecError(
            ("model.vocab_size",), f"byte-level data needs at least 256 token ids, got {m.vocab_size}."
        )
    if not 0.0 < d.val_fraction < 1.0:
        yield SpecError(("data.val_fraction",), f"must lie strictly between 0 and 1, got {d.val_fraction}.")
    yield from _data_path(d)


def _data_path(d: DataConfig) -> Iterator[SpecError]:
    if d.kind not in ("text", "jsonl"):
        return
    if not d.path:
        yield SpecError(("data.path",), f"data.kind={d.kind} reads files: set data.path to a file or a glob.")
        return
    if not glob.glob(d.path):
        yield SpecError(
            ("data.path",),
            f"no file matches '{d.path}'. Give an existing file or a glob that matches one "
            "(relative paths start from the directory `train` runs in).",
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


RULES: tuple[Rule, ...] = (_model_and_data, _batching)
"""This module's rules, in the order they report."""
