"""Fill model.vocab_size from the tokenizer when it is left null, before the rules run and spec.yaml is written.

The built-in GPT and the Hugging Face presets get the tokenizer's size padded to a multiple of
64 (256 for bytes); a Hugging Face model directory keeps the size of its config.json unless
model.resize_embeddings asks for the tokenizer's. spec.yaml then holds the number, so a rank
never needs the tokenizer to know the model's shape.
"""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, open_dict

from launcher.groups.model.hf_files import local_dir, local_vocab_size
from launcher.groups.tokenizer import folder_problem, padded_vocab_size, tokenizer_size
from launcher.spec import RunSpec, SpecError


def fill_vocab(cfg: DictConfig, spec: RunSpec) -> tuple[RunSpec, list[SpecError]]:
    """The spec (and cfg) with model.vocab_size filled in; or the tokenizer's problem."""
    m, tok = spec.model, spec.tokenizer
    if m.vocab_size is not None:
        return spec, []
    if tok.kind == "hf":
        problem = folder_problem(tok.path)
        if problem:
            return spec, [SpecError(("tokenizer.path",), f"{problem}.")]
    folder = local_dir(m)
    if folder is not None and not m.resize_embeddings:
        size = local_vocab_size(folder)
        if size is None:
            return spec, []  # the model rules say what is wrong with the directory
    else:
        try:
            size = padded_vocab_size(tokenizer_size(tok))
        except Exception as err:  # a folder that looks right but does not load
            return spec, [
                SpecError(("tokenizer.path",), f"the tokenizer in '{tok.path}' does not load ({err}).")
            ]
    with open_dict(cfg):
        cfg.model.vocab_size = size
    return dataclasses.replace(spec, model=dataclasses.replace(m, vocab_size=size)), []
