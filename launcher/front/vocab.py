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

from omegaconf import DictConfig

from launcher.components.data.tokenizer import (
    load_problem,
    load_tokenizer,
    padded_vocab_size,
    resolve_auto,
    tokenizer_size,
)
from launcher.components.model.hf_files import local_dir, local_vocab_size
from launcher.config.model import ModelConfig
from launcher.config.tokenizer import TokenizerConfig
from launcher.front.config_values import typed, with_values
from launcher.spec import RunSpec, SpecError


def choose_tokenizer(cfg: DictConfig) -> DictConfig:
    """The config with `tokenizer.kind=auto` decided (`auto_reason` says why, for the dry run)."""
    tokenizer, model = typed(cfg, "tokenizer"), typed(cfg, "model")
    if tokenizer is None or model is None:
        return cfg
    tok, _ = resolve_auto(tokenizer, local_dir(model))
    if tok == tokenizer:
        return cfg
    return with_values(cfg, {"tokenizer.kind": tok.kind, "tokenizer.path": tok.path})


def fill_vocab(cfg: DictConfig) -> tuple[DictConfig, list[SpecError]]:
    """The config with the tokenizer chosen, tokenizer.add_bos and model.vocab_size filled in; or the tokenizer's problem."""
    cfg = choose_tokenizer(cfg)
    tok, m = typed(cfg, "tokenizer"), typed(cfg, "model")
    if tok is None or m is None:
        return cfg, []
    problem = load_problem(tok)
    if problem:
        keys = ("tokenizer.path",) if tok.path != local_dir(m) else ("tokenizer.path", "model.path")
        return cfg, [SpecError(keys, f"{problem}.")]
    values: dict[str, object] = {}
    if tok.add_bos is None:  # whether the tokenizer itself puts bos before a text (Llama's does)
        values["tokenizer.add_bos"] = load_tokenizer(tok).adds_bos
    if m.vocab_size is None:
        size = _vocab_size(m, tok)
        if size is not None:
            values["model.vocab_size"] = size
    return with_values(cfg, values), []


def _vocab_size(m: ModelConfig, tok: TokenizerConfig) -> int | None:
    """A folder model's own vocabulary size, else the tokenizer's padded; None: the model rules say what is wrong."""
    folder = local_dir(m)
    if folder is not None and not m.resize_embeddings:
        return local_vocab_size(folder)
    return padded_vocab_size(tokenizer_size(tok))


def auto_reason(spec: RunSpec) -> str | None:
    """Why `tokenizer=auto` gave this validated spec's tokenizer (for the dry run); None when auto would not have."""
    tok, folder = spec.tokenizer, local_dir(spec.model)
    asked = dataclasses.replace(tok, kind="auto", path=None if tok.path == folder else tok.path)
    chosen, reason = resolve_auto(asked, folder)
    return reason if chosen == tok else None
