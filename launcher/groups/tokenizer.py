"""The tokenizer group: bytes (the offline default) or a local Hugging Face tokenizer folder.

Both turn a document given as text segments, each marked trained or not (a prompt is not, an
answer is), into token ids and a per-token trained flag; the data group turns the flags into
labels. Chat conversations are rendered with the tokenizer's own chat template, or with the
built-in one below where it has none.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

TOKENIZER_KINDS = ("bytes", "hf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
"""Files of which a Hugging Face tokenizer folder holds at least one (fast, sentencepiece, BPE vocab)."""
CHAT_ROLES = ("system", "user", "assistant", "tool")
VOCAB_MULTIPLE = 64
"""The built-in GPT pads its vocabulary to a multiple of this (tensor-core friendly matrix shapes)."""


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    """How text becomes token ids."""

    kind: str = "bytes"
    """bytes (each UTF-8 byte is a token, 256 ids, nothing to download) or hf (a local Hugging Face tokenizer)."""
    path: str | None = None
    """kind=hf: a local folder with tokenizer.json (or tokenizer.model / vocab.json) and tokenizer_config.json."""
    add_bos: bool = False
    """Put the tokenizer's bos token before every document (text and instruction formats)."""
    add_eos: bool = True
    """Put the eos token after every document (text, instruction); bytes: the 0 byte. Chat: the template decides."""


class Tokenizer(Protocol):
    """What the data group needs of a tokenizer."""

    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
        """Token ids of the joined segments, and per token whether its segment is trained."""
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


def default_chat(messages: list[dict[str, Any]], eos: str, *, add_generation_prompt: bool) -> str:
    """The built-in chat layout: `<|role|>` line, content, eos, newline per message."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}{eos}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; the 0 byte ends a document (eos), there is no bos."""

    name = "bytes"
    vocab_size = 256
    bos_id = None
    eos_id = 0
    has_chat_template = False

    def encode(self, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
        """Bytes of each segment, flagged with the segment's trained flag."""
        ids: list[int] = []
        trained: list[bool] = []
        for text, is_trained in segments:
            data = text.encode("utf-8", "surrogateescape")  # bytes read from a file survive unchanged
            ids.extend(data)
            trained.extend([is_trained] * len(data))
        return ids, trained

    def render_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, tools: list[dict] | None = None
    ) -> str:
        """The built-in chat layout, messages ended by the 0 byte (it renders no tools: the data group refuses them)."""
        return default_chat(messages, "\0", add_generation_prompt=add_generation_prompt)

    def special_tokens(self) -> dict[str, str]:
        """Only eos: the 0 byte."""
        return {"eos": "\\x00 (id 0)"}


class HFTokenizer:
    """A local Hugging Face tokenizer folder, loaded with transformers.AutoTokenizer (no download, no remote code)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.path = path
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        self.name = f"{type(self.tok).__name__} ({path})"
        self.vocab_size = len(self.tok)
        self.bos_id = self.tok.bos_token_id
        self.eos_id = self.tok.eos_token_id

    def encode(self, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
        """Tokenize the joined text once; a token is trained when its first character is in a trained segment."""
        text = "".join(s for s, _ in segments)
        if not text:
            return [], []
        if not getattr(self.tok, "is_fast", False):  # no offsets: tokenize each segment on its own
            ids, trained = [], []
            for segment, is_trained in segments:
                part = self.tok(segment, add_special_tokens=False)["input_ids"]
                ids.extend(part)
                trained.extend([is_trained] * len(part))
            return ids, trained
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        owner = []  # trained flag of every character
        for segment, is_trained in segments:
            owner.extend([is_trained] * len(segment))
        flags = [owner[min(start, len(owner) - 1)] for start, _ in enc["offset_mapping"]]
        return list(enc["input_ids"]), flags

    def render_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, tools: list[dict] | None = None
    ) -> str:
        """The tokenizer's chat template (given the tools), or the built-in layout (with its eos) where it has none."""
        if getattr(self.tok, "chat_template", None):
            return self.tok.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        return default_chat(messages, self.tok.eos_token or "", add_generation_prompt=add_generation_prompt)

    def special_tokens(self) -> dict[str, str]:
        """bos, eos, pad, unk as the tokenizer names them (ids in brackets)."""
        found = {}
        for name in ("bos", "eos", "pad", "unk"):
            token = getattr(self.tok, f"{name}_token", None)
            if token:
                found[name] = f"{token} (id {getattr(self.tok, f'{name}_token_id')})"
        return found

    @property
    def has_chat_template(self) -> bool:
        """Whether the folder brings its own chat template."""
        return bool(getattr(self.tok, "chat_template", None))


def load_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer the config names; loaded once per process (checks, dry run and tokenization share it)."""
    if cfg.kind == "hf":
        if not cfg.path:
            raise ValueError("tokenizer.kind=hf needs tokenizer.path, a local tokenizer folder.")
        return _hf_tokenizer(str(Path(cfg.path).resolve()))
    return ByteTokenizer()


@functools.lru_cache(maxsize=4)
def _hf_tokenizer(path: str) -> HFTokenizer:
    return HFTokenizer(path)


def folder_problem(path: str | None) -> str | None:
    """Why `path` is not a tokenizer folder, or None; reads the folder only (no transformers import)."""
    if not path:
        return "tokenizer.kind=hf needs tokenizer.path, a local folder holding a Hugging Face tokenizer"
    folder = Path(path)
    if not folder.is_dir():
        return f"tokenizer.path '{path}' is not a directory"
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return (
            f"'{path}' holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); save one there with "
            "`tokenizer.save_pretrained(DIR)`"
        )
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            json.loads(config.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return f"{config} is not valid JSON ({err})"
    return None


def fingerprint(cfg: TokenizerConfig) -> str:
    """A hash of the tokenizer's identity: its kind and options, and the bytes of every file of its folder."""
    digest = hashlib.sha256(f"{cfg.kind}:{cfg.add_bos}:{cfg.add_eos}".encode())
    if cfg.kind == "hf" and cfg.path:
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
