"""Every data-size fact, checked before launch: one optimizer step's sequences, a held-out batch for every rank.

The corpus is tokenized by then (front/tokenize.py), so the counts are the ranks' own: sequences
of the packed stream, documents cut at seq_len, or the token-budget batches the first epoch forms.
Data too small for one step, or held-out data too small for every data-parallel rank while
evaluation is on, is refused with the numbers and the fixes (exit status 2), before the run
directory is made; a rank would otherwise stop with a traceback, or, at the final evaluation,
after training its last step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from launcher.components.data.mixture import single_configs
from launcher.components.data.sizes import StepNeeds, document_sequences, packed_sequences
from launcher.components.data.tokens import corpus_folder
from launcher.components.files.token_cache import read_meta
from launcher.parallel.dims import ParallelDims
from launcher.spec import RunSpec, SpecError

SPLITS = {
    "val_path": "the files of data.val_path",
    "tail": "the tail of data.path's token stream: it holds fewer than 100 documents",
    "hash": "whole documents of data.path chosen by a hash of their keys",
}
"""How the held-out side was made (meta.json's `split`), for messages."""


def step_needs(spec: RunSpec) -> StepNeeds:
    """What one optimizer step and one evaluation take, on the spec's data-parallel degree."""
    t = spec.train
    dp_size = ParallelDims.of(spec.parallel, spec.launcher.world_size).dp_size
    return StepNeeds(
        micro_batch_size=t.micro_batch_size, grad_accum_steps=t.grad_accum_steps, dp_size=dp_size
    )


def size_errors(spec: RunSpec) -> list[SpecError]:
    """The data-size problems of a spec whose corpus tokenizes; empty when the data is enough."""
    needs = step_needs(spec)
    if spec.data.sources:  # a source wraps its epochs: one sequence to draw from, its own held-out batches
        one = StepNeeds(micro_batch_size=1, grad_accum_steps=1, dp_size=1)
        sources = [(dataclasses.replace(spec, data=data), one) for data in single_configs(spec.data)]
    else:
        sources = [(spec, needs)]
    errors: list[SpecError] = []
    for source, train_needs in sources:
        with corpus_folder(source.data, source.tokenizer) as folder:
            meta = read_meta(folder)
            errors += _train_errors(source, folder, meta, train_needs)
        if spec.train.evaluates():
            errors += _val_errors(source, meta, needs)
    return errors


def _count(number: int, noun: str, plural: str = "s") -> str:
    """`1 sequence`, `2 sequences`."""
    return f"{number:,} {noun}{plural * (number != 1)}"


def _ranks(needs: StepNeeds) -> str:
    return _count(needs.dp_size, "data-parallel rank")


def _train_errors(spec: RunSpec, folder: Path, meta: dict[str, Any], needs: StepNeeds) -> list[SpecError]:
    """One optimizer step's worth of training sequences (token budget: global micro batches), or why not."""
    d, t = spec.data, spec.train
    tokens = meta["sizes"]["train"]
    if d.format in ("preference", "kto"):  # one pair (kto: example) per document, never cut or packed
        from launcher.front.pair_data import usable_pairs  # the pairs the ranks keep (a few may be dropped)

        available = usable_pairs(spec) if tokens else 0
        how = (
            f"{available:,} training {'examples' if d.format == 'kto' else 'pairs'}, one per micro batch slot"
        )
    elif d.packing:
        available = packed_sequences(tokens, d.seq_len)
        how = f"{tokens:,} training tokens packed back to back: ({tokens:,} - 1) // {d.seq_len}"
    elif d.batching == "token_budget":
        return _budget_errors(spec, needs)
    else:
        flags = (
            np.memmap(folder / "train.flags", dtype=np.uint8, mode="r") if tokens else np.zeros(0, np.uint8)
        )
        available = document_sequences(flags, d.seq_len)
        how = (
            f"{meta['num_documents']['train']:,} training documents of {tokens:,} tokens, one per sequence, "
            f"each longer one cut at {d.seq_len}"
        )
    if available >= needs.train_sequences:
        return []
    packing = (
        "" if d.packing or d.format in ("preference", "kto") else "pack documents with data.packing=true, "
    )
    return [
        SpecError(
            ("data.seq_len", "data.packing", "train.micro_batch_size", "train.grad_accum_steps", "data.path"),
            f"the training data makes {_count(available, 'sequence')} of {d.seq_len} tokens ({how}), fewer than one "
            f"optimizer step needs: {needs.train_sequences:,} = train.micro_batch_size {t.micro_batch_size} x "
            f"train.grad_accum_steps {t.grad_accum_steps} x {_ranks(needs)}. Nothing was started. Lower "
            f"data.seq_len, {packing}use more data, or lower train.micro_batch_size (or train.grad_accum_steps, "
            "launcher.nproc).",
        )
    ]


def _budget_errors(spec: RunSpec, needs: StepNeeds) -> list[SpecError]:
    """Token-budget batching: the global micro batches of the first epoch against train.grad_accum_steps."""
    from launcher.components.data.batching import (  # torch: only this batching needs it
        Documents,
        TokenBudgetStream,
    )
    from launcher.components.data.tokens import load_corpus

    d, t = spec.data, spec.train
    documents = Documents(load_corpus(d, spec.tokenizer).train, d.seq_len)
    try:
        available = TokenBudgetStream(
            documents, max_tokens=int(d.max_tokens_per_batch or 0), seed=t.seed, world_size=needs.dp_size
        ).batches_per_epoch
    except ValueError:  # not one global micro batch
        available = 0
    if available >= t.grad_accum_steps:
        return []
    return [
        SpecError(
            ("data.max_tokens_per_batch", "train.grad_accum_steps", "data.seq_len", "data.path"),
            f"the training data makes {_count(available, 'global micro batch', 'es')} ({len(documents):,} sequences cut into "
            f"batches of at most data.max_tokens_per_batch={d.max_tokens_per_batch} padded tokens, one per "
            f"rank on {_ranks(needs)}), fewer than one optimizer step needs: train.grad_accum_steps "
            f"{t.grad_accum_steps}. Nothing was started. Lower data.max_tokens_per_batch or "
            "train.grad_accum_steps, use more data, or pack it (data.packing=true).",
        )
    ]


def _val_errors(spec: RunSpec, meta: dict[str, Any], needs: StepNeeds) -> list[SpecError]:
    """While evaluation is on, a held-out sequence for every data-parallel rank, or why not."""
    d = spec.data
    tokens = meta["sizes"]["val"]
    available = packed_sequences(tokens, d.seq_len)  # held-out data is always packed (evaluation is in order)
    if available >= needs.val_sequences:
        return []
    where = SPLITS.get(meta.get("split", ""), "data.path's held-out share")
    more = (
        "more records in data.val_path"
        if d.val_path
        else f"a larger data.val_fraction (now {d.val_fraction}) or held-out files with data.val_path"
    )
    return [
        SpecError(
            ("data.val_fraction", "data.val_path", "data.seq_len", "train.eval_every"),
            f"the held-out data holds {_count(available, 'sequence')} of {d.seq_len} tokens ({tokens:,} tokens from "
            f"{where}: ({tokens:,} - 1) // {d.seq_len}), fewer than the {_ranks(needs)}, each of which "
            f"evaluates at least one (train.eval_every={spec.train.eval_every}). Nothing was started. Give "
            f"{more}, lower data.seq_len, or turn evaluation off with train.eval_every=null.",
        )
    ]
