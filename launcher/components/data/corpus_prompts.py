"""Prompts read from a tokenized corpus, for a source whose completions the model writes (on-policy distillation).

A document's prompt is its untrained prefix, the part a chat or instruction record renders before the
first trained token (the assistant's answer). A document whose every token is trained (plain text)
is cut into windows of prompt_tokens + max_new_tokens tokens, each window's first prompt_tokens tokens
a prompt (a short document gives none). The data's own completion follows the prompt: the document's
next tokens, at most `max_new_tokens` of them (what GKD trains on off-policy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from launcher.components.data.prompts import Prompt, decode
from launcher.components.data.tokenizer import Tokenizer
from launcher.components.data.tokens import START, TRAINED, TokenStore


@dataclass(frozen=True)
class Prompts:
    """Each usable document's prompt span and the span of its own completion, as offsets into the store."""

    tokens: np.ndarray
    """The store's 1-D token ids (memory-mapped: only the spans below are read)."""
    starts: np.ndarray
    """int64 [N]: each prompt's first token."""
    splits: np.ndarray
    """int64 [N]: each prompt's end, where its own completion begins."""
    ends: np.ndarray
    """int64 [N]: the end of that completion (at most max_new_tokens after the split)."""

    def __len__(self) -> int:
        return len(self.starts)

    def prompt(self, index: int) -> list[int]:
        """Prompt `index`'s token ids."""
        return [int(t) for t in self.tokens[self.starts[index] : self.splits[index]]]

    def completion(self, index: int) -> list[int]:
        """The data's own completion of prompt `index` (the document's next tokens)."""
        return [int(t) for t in self.tokens[self.splits[index] : self.ends[index]]]

    def longest(self) -> int:
        """Tokens of the longest prompt (0 without prompts)."""
        return int((self.splits - self.starts).max()) if len(self) else 0


def _windows(starts: np.ndarray, ends: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, document end) of every whole window of `width` tokens of the documents [starts, ends)."""
    counts = np.maximum((ends - starts) // width, 0)
    owner = np.repeat(np.arange(len(starts)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    return starts[owner] + (np.arange(len(owner)) - first) * width, ends[owner]


def prompt_spans(store: TokenStore, *, prompt_tokens: int, max_new_tokens: int) -> Prompts:
    """The prompts of every document of `store`: a prompted record's prompt, or a text document's windows."""
    tokens, flags = np.asarray(store.tokens), np.asarray(store.flags)
    total = len(tokens)
    starts = np.flatnonzero(flags & START).astype(np.int64)
    if total and (not len(starts) or starts[0] != 0):
        starts = np.concatenate([[0], starts])
    doc_ends = np.append(starts[1:], total).astype(np.int64)
    trained = np.flatnonzero(flags & TRAINED).astype(np.int64)
    first = np.searchsorted(trained, starts)  # each document's first trained token, if inside it
    first_trained = np.where(first < len(trained), trained[np.minimum(first, len(trained) - 1)], total)
    prompted = (first_trained > starts) & (first_trained < doc_ends)
    text_starts, text_ends = _windows(starts[~prompted], doc_ends[~prompted], prompt_tokens + max_new_tokens)
    order = np.argsort(np.concatenate([starts[prompted], text_starts]), kind="stable")  # the store's order
    starts = np.concatenate([starts[prompted], text_starts])[order]
    splits = np.concatenate([first_trained[prompted], text_starts + prompt_tokens])[order]
    ends = np.minimum(splits + max_new_tokens, np.concatenate([doc_ends[prompted], text_ends])[order])
    keep = ends > splits
    return Prompts(tokens=tokens, starts=starts[keep], splits=splits[keep], ends=ends[keep])


class CorpusPrompts(Sequence[Prompt]):
    """The prompts of `spans` as the rollout source reads them (Prompt records), made one at a time when read."""

    def __init__(self, spans: Prompts, tokenizer: Tokenizer) -> None:
        self.spans, self.tokenizer = spans, tokenizer

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, index: int) -> Prompt:  # type: ignore[override]  # one prompt, never a slice
        ids = self.spans.prompt(index)
        return Prompt(ids=tuple(ids), text=decode(self.tokenizer, ids))
