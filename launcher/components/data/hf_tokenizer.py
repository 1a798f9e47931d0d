"""A local Hugging Face tokenizer folder loaded with transformers (no download, no remote code), and its fast
batched encoding: ids straight from the Rust tokenizer where that gives the same ids, trained flags from offsets."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from launcher.components.data.byte_tokenizer import default_chat
from launcher.components.data.tokenizer_folder import refuse_custom_tokenizer

if TYPE_CHECKING:  # numpy only where records are encoded
    import numpy as np


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


@functools.lru_cache(maxsize=4)
def cached_tokenizer(path: str) -> HFTokenizer:
    """The folder's tokenizer, loaded once per process (checks, dry run and tokenization share it)."""
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
