"""Schema of the tokenizer group: auto (the default), bytes, or a local Hugging Face tokenizer folder.

What the group builds at run time lives in launcher.components.data.tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

TOKENIZER_KINDS = ("auto", "bytes", "hf")
FOLDER_KINDS = ("hf",)
"""Tokenizer kinds read from a local folder (tokenizer.path): what the data group, the cache and the checks ask."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
"""Files of which a Hugging Face tokenizer folder holds at least one (fast, sentencepiece, BPE vocab)."""
MODEL_FILES = ("tokenizer.model", "spiece.model")
"""Slow-tokenizer model files transformers converts to a fast tokenizer when tokenizer.json is absent."""
INSTALL_HINT = "pip install {packages} (scripts/install does: they are in the `data` extra)"
CHAT_ROLES = ("system", "user", "assistant", "tool")
VOCAB_MULTIPLE = 64
"""The built-in GPT pads its vocabulary to a multiple of this (tensor-core friendly matrix shapes)."""


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    """How text becomes token ids."""

    kind: str = "auto"
    """auto (the model folder's tokenizer when model.path holds one, else bytes), bytes (each UTF-8 byte is a token, 256 ids) or hf (a local Hugging Face tokenizer)."""
    path: str | None = None
    """kind=hf: a local folder with tokenizer.json, tokenizer.model (SentencePiece) or vocab.json + merges.txt, and tokenizer_config.json."""
    add_bos: bool | None = None
    """Put the tokenizer's bos token before every document (text and instruction formats); null: as the tokenizer itself does (Llama's SentencePiece tokenizers do, bytes never)."""
    add_eos: bool = True
    """Put the eos token after every document (text, instruction); bytes: the 0 byte. Chat: the template decides."""

    @property
    def reads_folder(self) -> bool:
        """Whether the tokenizer is a local folder's (FOLDER_KINDS: tokenizer.path), not the built-in bytes."""
        return self.kind in FOLDER_KINDS
