"""The tokenizer group: auto (the default), bytes, or a local Hugging Face tokenizer folder.

`auto` is decided once in the launching process (`resolve_auto`): the model folder's own tokenizer
when model.path holds one, else bytes; spec.yaml records the choice, so ranks never see `auto`.

Both turn a document given as text segments, each marked trained or not (a prompt is not, an
answer is), into token ids and a per-token trained flag; the data group turns the flags into
labels. Chat conversations are rendered with the tokenizer's own chat template, or with the
built-in one where it has none.

The bytes tokenizer and that built-in chat layout are launcher.components.data.byte_tokenizer; a folder's
tokenizer is launcher.components.data.hf_tokenizer, judged before loading by
launcher.components.data.tokenizer_folder. This module names what a tokenizer offers, loads the one the
config names and decides `auto`.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from launcher.components.data.byte_tokenizer import ByteTokenizer
from launcher.components.data.hf_tokenizer import cached_tokenizer
from launcher.components.data.tokenizer_folder import folder_problem, is_byte_export
from launcher.components.files.tokenizer_file import load_failure
from launcher.config.tokenizer import TOKENIZER_FILES, VOCAB_MULTIPLE, TokenizerConfig

if TYPE_CHECKING:  # numpy only where records are encoded: the launching process answers --help without it
    import numpy as np


class Tokenizer(Protocol):
    """What the data group needs of a tokenizer."""

    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    adds_bos: bool

    def encode(self, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
        """Token ids of the joined segments, and per token whether its segment is trained."""
        ...

    def encode_batch(self, documents: list[list[tuple[str, bool]]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """`encode` of many documents at once: (int64 ids, bool trained) arrays of each, in order."""
        ...

    has_chat_template: bool

    def render_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, tools: list[dict] | None = None
    ) -> str:
        """A conversation (and the tool specs it may call) as the text the model is trained on."""
        ...

    def special_tokens(self) -> dict[str, str]:
        """Name -> token text of the special tokens, for the dry run."""
        ...


def load_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer the config names; loaded once per process (checks, dry run and tokenization share it)."""
    if cfg.reads_folder:
        if not cfg.path:
            raise ValueError("tokenizer.kind=hf needs tokenizer.path, a local tokenizer folder.")
        return cached_tokenizer(str(Path(cfg.path).resolve()))
    return ByteTokenizer()


def load_problem(cfg: TokenizerConfig) -> str | None:
    """Why the configured tokenizer does not load (the folder's problem, a missing package, transformers' error), or None."""
    if not cfg.reads_folder:
        return None
    problem = folder_problem(cfg.path)
    if problem:
        return problem
    try:
        load_tokenizer(cfg)
    except Exception as err:  # a folder that looks right but does not load: say what transformers said, once
        return load_failure(str(cfg.path), err)
    return None


def resolve_auto(cfg: TokenizerConfig, model_folder: str | None) -> tuple[TokenizerConfig, str]:
    """`kind=auto` decided, and why: tokenizer.path when set, else the model folder's own tokenizer when it
    holds tokenizer files, else bytes (the built-in GPT, the hf_* presets, a folder without a tokenizer)."""
    if cfg.kind != "auto":
        return cfg, f"tokenizer.kind={cfg.kind} as configured"
    if cfg.path is not None:
        return replace(cfg, kind="hf"), f"tokenizer.path names a tokenizer folder ('{cfg.path}')"
    if model_folder is None:
        reason = "a model built from a config (no pretrained folder) trains on bytes by default"
        return replace(cfg, kind="bytes"), reason
    folder = Path(model_folder)
    if is_byte_export(folder):
        reason = f"the model folder '{model_folder}' holds the byte tokenizer `train-export` writes (eos the 0 byte)"
        return replace(cfg, kind="bytes"), reason
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        reason = f"the model folder '{model_folder}' holds its own tokenizer"
        return replace(cfg, kind="hf", path=model_folder), reason
    return replace(cfg, kind="bytes"), f"the model folder '{model_folder}' holds no tokenizer files"


def fingerprint(cfg: TokenizerConfig) -> str:
    """A hash of the tokenizer's identity: its kind and options, and the bytes of every file of its folder."""
    digest = hashlib.sha256(f"{cfg.kind}:{cfg.add_bos}:{cfg.add_eos}".encode())
    if cfg.reads_folder and cfg.path:
        for file in sorted(Path(cfg.path).iterdir()):
            if file.is_file():
                digest.update(file.name.encode())
                digest.update(file.read_bytes())
    return digest.hexdigest()


def padded_vocab_size(size: int) -> int:
    """`size` rounded up to a multiple of VOCAB_MULTIPLE."""
    return -(-size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def tokenizer_size(cfg: TokenizerConfig) -> int:
    """Token ids the tokenizer produces (bytes: 256; hf: its vocabulary with added tokens)."""
    return load_tokenizer(cfg).vocab_size
