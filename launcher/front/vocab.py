"""Decide `tokenizer=auto` and fill model.vocab_size from the tokenizer, before the rules run and spec.yaml is written.

`tokenizer=auto` becomes the model folder's own tokenizer (kind hf, path the folder) when model.path
holds one, else bytes: spec.yaml records the choice, so ranks, export and generation never see `auto`.
The built-in GPT and the Hugging Face presets get the tokenizer's size padded to a multiple of
64 (256 for bytes); a Hugging Face model directory keeps the size of its config.json unless
model.resize_embeddings asks for the tokenizer's. spec.yaml then holds the number, so a rank
never needs the tokenizer to know the model's shape.
"""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, open_dict

from launcher.groups.model.hf_files import local_dir, local_vocab_size
from launcher.groups.tokenizer import (
    load_problem,
    load_tokenizer,
    padded_vocab_size,
    resolve_auto,
    tokenizer_size,
)
from launcher.spec import RunSpec, SpecError


def choose_tokenizer(cfg: DictConfig, spec: RunSpec) -> RunSpec:
    """The spec (and cfg) with `tokenizer.kind=auto` decided (`auto_reason` says why, for the dry run)."""
    tok, _ = resolve_auto(spec.tokenizer, local_dir(spec.model))
    if tok == spec.tokenizer:
        return spec
    with open_dict(cfg):
        cfg.tokenizer.kind = tok.kind
        cfg.tokenizer.path = tok.path
    return dataclasses.replace(spec, tokenizer=tok)


def fill_vocab(cfg: DictConfig, spec: RunSpec) -> tuple[RunSpec, list[SpecError]]:
    """The spec (and cfg) with the tokenizer chosen and model.vocab_size filled in; or the tokenizer's problem."""
    spec = choose_tokenizer(cfg, spec)
    problem = load_problem(spec.tokenizer)
    if problem:
        keys = (
            ("tokenizer.path",)
            if spec.tokenizer.path != local_dir(spec.model)
            else ("tokenizer.path", "model.path")
        )
        return spec, [SpecError(keys, f"{problem}.")]
    spec = _fill_add_bos(cfg, spec)
    m, tok = spec.model, spec.tokenizer
    if m.vocab_size is not None:
        return spec, []
    folder = local_dir(m)
    if folder is not None and not m.resize_embeddings:
        size = local_vocab_size(folder)
        if size is None:
            return spec, []  # the model rules say what is wrong with the directory
    else:
        size = padded_vocab_size(tokenizer_size(tok))
    with open_dict(cfg):
        cfg.model.vocab_size = size
    return dataclasses.replace(spec, model=dataclasses.replace(m, vocab_size=size)), []


def _fill_add_bos(cfg: DictConfig, spec: RunSpec) -> RunSpec:
    """tokenizer.add_bos=null decided: whether the tokenizer itself puts bos before a text (Llama's does)."""
    tok = spec.tokenizer
    if tok.add_bos is not None:
        return spec
    adds_bos = load_tokenizer(tok).adds_bos
    with open_dict(cfg):
        cfg.tokenizer.add_bos = adds_bos
    return dataclasses.replace(spec, tokenizer=dataclasses.replace(tok, add_bos=adds_bos))


def auto_reason(spec: RunSpec) -> str | None:
    """Why `tokenizer=auto` gave this validated spec's tokenizer (for the dry run); None when auto would not have."""
    tok, folder = spec.tokenizer, local_dir(spec.model)
    asked = dataclasses.replace(tok, kind="auto", path=None if tok.path == folder else tok.path)
    chosen, reason = resolve_auto(asked, folder)
    return reason if chosen == tok else None
