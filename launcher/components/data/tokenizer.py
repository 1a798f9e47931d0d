"""The tokenizer group: auto (the default), bytes, or a local Hugging Face tokenizer folder.

`auto` is decided once in the launching process (`resolve_auto`): the model folder's own tokenizer
when model.path holds one, else bytes; spec.yaml records the choice, so ranks never see `auto`.

Both turn a document given as text segments, each marked trained or not (a prompt is not, an
answer is), into token ids and a per-token trained flag; the data group turns the flags into
labels. Chat conversations are rendered with the tokenizer's own chat template, or with the
built-in one below where it has none.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from launcher.components.files.safe_load import RefusedFile
from launcher.components.files.tokenizer_file import load_failure
from launcher.components.model.hf_files import NO_REMOTE_CODE
from launcher.config.tokenizer import (
    INSTALL_HINT,
    MODEL_FILES,
    TOKENIZER_FILES,
    VOCAB_MULTIPLE,
    TokenizerConfig,
)

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
    adds_bos = False

    def encode(self, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
        """Bytes of each segment, flagged with the segment's trained flag."""
        ids: list[int] = []
        trained: list[bool] = []
        for text, is_trained in segments:
            data = text.encode("utf-8", "surrogateescape")  # bytes read from a file survive unchanged
            ids.extend(data)
            trained.extend([is_trained] * len(data))
        return ids, trained

    def encode_batch(self, documents: list[list[tuple[str, bool]]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """`encode` of each document as arrays: the bytes as they are, each byte flagged with its segment's flag."""
        import numpy as np

        encoded = []
        for segments in documents:
            parts = [text.encode("utf-8", "surrogateescape") for text, _ in segments]
            ids = np.frombuffer(b"".join(parts), dtype=np.uint8)
            flags = np.array([is_trained for _, is_trained in segments], dtype=bool)
            encoded.append((ids, np.repeat(flags, [len(part) for part in parts])))
        return encoded

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
        self.path = path
        self.tok = open_folder(path)
        self.name = f"{type(self.tok).__name__} ({path})"
        self.vocab_size = len(self.tok)
        self.bos_id = self.tok.bos_token_id
        self.eos_id = self.tok.eos_token_id
        # whether _ids may ask the Rust tokenizer alone (None: not known until the first batch)
        self._direct: bool | None = None

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

    def encode_batch(self, documents: list[list[tuple[str, bool]]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """`encode` of many documents in one call of the fast tokenizer; offsets only for the documents whose
        segments differ in their flag, the flags from them with array operations."""
        import numpy as np

        if not getattr(self.tok, "is_fast", False):
            pairs = [self.encode(segments) for segments in documents]
            return [(np.asarray(ids, dtype=np.int64), np.asarray(flags, dtype=bool)) for ids, flags in pairs]
        empty = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool))
        encoded: list[tuple[np.ndarray, np.ndarray]] = [empty] * len(documents)
        texts = ["".join(text for text, _ in segments) for segments in documents]
        mixed = [len({flag for text, flag in segments if text}) > 1 for segments in documents]
        for with_offsets in (False, True):
            chosen = [i for i, text in enumerate(texts) if text and mixed[i] == with_offsets]
            if not chosen:
                continue
            batch = [texts[i] for i in chosen]
            if with_offsets:
                enc = self.tok(batch, add_special_tokens=False, return_offsets_mapping=True, **_IDS_ONLY)
                rows, offsets = enc["input_ids"], enc["offset_mapping"]
            else:
                rows = self._ids(batch)
            for row, i in enumerate(chosen):
                ids = np.array(rows[row], dtype=np.int64)
                if with_offsets:
                    flags = _segment_flags(documents[i], offsets[row], len(texts[i]))
                else:  # one flag for the whole document: the flag of its non-empty segments
                    flags = np.full(len(ids), next(flag for text, flag in documents[i] if text), dtype=bool)
                encoded[i] = (ids, flags)
        return encoded

    def _ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text as `self.tok(texts, add_special_tokens=False)` gives them; straight from the
        Rust tokenizer without offsets when the class adds nothing to it and the first texts agree (`_direct`)."""
        if self._direct is None:
            sample = texts[:CHECKED_TEXTS]
            expected = self.tok(sample, add_special_tokens=False, **_IDS_ONLY)["input_ids"]
            self._direct = _plain_call(self.tok) and _fast_ids(self.tok, sample) == expected
        if self._direct:
            return _fast_ids(self.tok, texts)
        return self.tok(texts, add_special_tokens=False, **_IDS_ONLY)["input_ids"]

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
    def adds_bos(self) -> bool:
        """Whether the tokenizer itself puts its bos token before a text (Llama's does, GPT-2's does not)."""
        ids = self.tok("a", add_special_tokens=True)["input_ids"]
        return self.bos_id is not None and bool(ids) and ids[0] == self.bos_id

    @property
    def has_chat_template(self) -> bool:
        """Whether the folder brings its own chat template."""
        return bool(getattr(self.tok, "chat_template", None))


CHECKED_TEXTS = 32
"""Texts of the first batch encoded both ways before ids are taken straight from the Rust tokenizer."""
_IDS_ONLY = {"return_attention_mask": False, "return_token_type_ids": False}
"""What a call of the tokenizer leaves out: only ids (and offsets where asked) are read."""


def _plain_call(tok: Any) -> bool:
    """Whether `tok(texts, add_special_tokens=False)` is the Rust tokenizer's encoding and nothing more: a fast
    tokenizer class that keeps transformers' own encoding methods, with no truncation or padding set."""
    from transformers import PreTrainedTokenizerFast

    methods = (
        "__call__",
        "_call_one",
        "encode_plus",
        "batch_encode_plus",
        "_encode_plus",
        "_batch_encode_plus",
    )
    backend = getattr(tok, "backend_tokenizer", None)
    return (
        isinstance(tok, PreTrainedTokenizerFast)
        and all(getattr(type(tok), m, None) is getattr(PreTrainedTokenizerFast, m, None) for m in methods)
        and hasattr(backend, "encode_batch_fast")
        and backend.truncation is None
        and backend.padding is None
    )


def _fast_ids(tok: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text from the Rust tokenizer, without special tokens and without tracking offsets."""
    return [e.ids for e in tok.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


def _segment_flags(
    segments: list[tuple[str, bool]], offsets: list[tuple[int, int]], length: int
) -> np.ndarray:
    """Per token the flag of the segment holding its first character (the last character's for one past the end)."""
    import numpy as np

    starts = np.fromiter((start for start, _ in offsets), dtype=np.int64, count=len(offsets))
    ends = np.cumsum([len(text) for text, _ in segments])
    owner = np.searchsorted(ends, np.minimum(starts, length - 1), side="right")
    return np.array([flag for _, flag in segments], dtype=bool)[owner]


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


def open_folder(path: str) -> Any:
    """A local tokenizer folder as transformers loads it (a slow tokenizer.model converted to a fast one), no download."""
    import logging

    from transformers import AutoTokenizer

    refuse_custom_tokenizer(path)
    # AutoTokenizer reads the folder's config.json too: a model_type transformers does not hold makes it warn
    # about the model before the launcher's own refusal of that config (the tokenizer itself loads fine)
    config_log = logging.getLogger("transformers.configuration_utils")
    level = config_log.level
    config_log.setLevel(logging.ERROR)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    finally:
        config_log.setLevel(level)


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
            settings = json.loads(config.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return f"{config} is not valid JSON ({err})"
        problem = _custom_code_problem(settings, config)
        if problem:
            return problem
    return _vocab_files_problem(folder) or _missing_packages(folder)


def _custom_code_reason(settings: object) -> str | None:
    """Why a tokenizer_config.json needs the folder's own code (auto_map to a class transformers lacks), or None."""
    if not isinstance(settings, dict) or not settings.get("auto_map"):
        return None
    import transformers  # only for a folder that asks for code: is the class one transformers ships?

    name = settings.get("tokenizer_class")
    if isinstance(name, str) and any(
        hasattr(transformers, n) for n in (name, f"{name}Fast", name.removesuffix("Fast"))
    ):
        return None
    return (
        f"it names code of its own (auto_map {settings['auto_map']} for tokenizer_class {name!r}, which "
        "transformers does not ship)"
    )


def _custom_code_problem(settings: object, config: Path) -> str | None:
    reason = _custom_code_reason(settings)
    return f"{config} was refused: {reason}. {NO_REMOTE_CODE}" if reason else None


def refuse_custom_tokenizer(folder: str | Path) -> None:
    """RefusedFile naming the folder's tokenizer_config.json when it needs the folder's own code."""
    config = Path(folder) / "tokenizer_config.json"
    try:
        reason = _custom_code_reason(json.loads(config.read_text()))
    except (OSError, ValueError):
        return
    if reason:
        raise RefusedFile(config, reason, True, advice=NO_REMOTE_CODE)


def _vocab_files_problem(folder: Path) -> str | None:
    """Why a folder of slow BPE files (vocab.json, merges.txt) cannot be read, or None."""
    if (folder / "tokenizer.json").is_file() or not (folder / "vocab.json").is_file():
        return None
    if any((folder / name).is_file() for name in MODEL_FILES):
        return None
    if not (folder / "merges.txt").is_file():
        return (
            f"'{folder}' holds vocab.json but not the merges.txt that goes with it (a BPE tokenizer needs both); "
            "copy merges.txt from where vocab.json came from"
        )
    if not (folder / "tokenizer_config.json").is_file() and not (folder / "config.json").is_file():
        return (
            f"'{folder}' holds vocab.json and merges.txt but no tokenizer_config.json saying which tokenizer reads "
            'them; add one, for GPT-2\'s files `{"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}`, '
            "or save the tokenizer there with `tokenizer.save_pretrained(DIR)`"
        )
    return None


def _missing_packages(folder: Path) -> str | None:
    """Which package reading the folder's slow tokenizer model needs and lacks (sentencepiece, protobuf, tiktoken)."""
    if (folder / "tokenizer.json").is_file():
        return None  # the fast tokenizer is read by `tokenizers` alone
    model = next((folder / name for name in MODEL_FILES if (folder / name).is_file()), None)
    if model is None:
        return None
    if is_tiktoken_file(model):
        kind, needed = "a tiktoken BPE file", ("tiktoken",)
    else:
        kind, needed = "a SentencePiece model", ("sentencepiece", "google.protobuf")
    missing = [name for name in needed if not _importable(name)]
    if not missing:
        return None
    packages = " ".join("protobuf" if name == "google.protobuf" else name for name in missing)
    return (
        f"{model} is {kind}, and reading it needs the {packages} package(s), which are not installed: "
        + INSTALL_HINT.format(packages=packages)
    )


def is_tiktoken_file(path: Path) -> bool:
    """Whether a tokenizer.model is tiktoken's text format (base64 token, space, rank per line), not SentencePiece's protobuf."""
    with path.open("rb") as file:
        first = file.readline(512).strip()
    token, _, rank = first.partition(b" ")
    return bool(token) and rank.isdigit() and all(c in _BASE64 for c in token)


_BASE64 = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=")


def _importable(name: str) -> bool:
    """Whether `name` imports (a package present on disk but blocked or broken counts as missing)."""
    import importlib

    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def load_problem(cfg: TokenizerConfig) -> str | None:
    """Why the configured tokenizer does not load (the folder's problem, a missing package, transformers' error), or None."""
    if cfg.kind != "hf":
        return None
    problem = folder_problem(cfg.path)
    if problem:
        return problem
    try:
        load_tokenizer(cfg)
    except Exception as err:  # a folder that looks right but does not load: say what transformers said, once
        return load_failure(str(cfg.path), err)
    return None


def is_byte_export(folder: Path) -> bool:
    """Whether the folder's tokenizer.json is the byte tokenizer `train-export` writes for a bytes run (256 byte
    tokens, no merges, nothing added): its eos lives in config.json, so the bytes tokenizer reads it exactly."""
    file = folder / "tokenizer.json"
    if not file.is_file() or file.stat().st_size > 64_000:
        return False
    try:
        saved = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    model = saved.get("model") if isinstance(saved, dict) else None
    if not isinstance(model, dict) or saved.get("added_tokens"):
        return False
    return model.get("type") == "BPE" and len(model.get("vocab") or {}) == 256 and not model.get("merges")


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
