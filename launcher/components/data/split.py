"""The held-out split of data.path: whole documents chosen by a hash of their keys, or, when the documents are
few, the tail of the token stream.

With many documents a hash of each document's key decides its side, so the split does not change with
file order, glob spelling or the number of ranks. With few (one text file, a handful of records) whole
documents cannot make a `data.val_fraction` share: a hash could send the only document to the held-out
side and leave nothing to train on. Below HASH_SPLIT_MIN_DOCUMENTS documents the corpus is kept in
order and its last tokens are held out, cut inside a document where the share ends. The first
documents wait in a `head` file until their number decides the rule, so tokenizing still streams.
"""

from __future__ import annotations

import os
import zlib
from typing import Protocol

import numpy as np

HASH_SPLIT_MIN_DOCUMENTS = 100
"""Documents in data.path from which whole documents are held out by hash; fewer: the token stream's tail."""


class Side(Protocol):
    """Where one side's tokens and flags are appended (tokens._Side)."""

    tokens_path: os.PathLike[str]
    flags_path: os.PathLike[str]
    dtype: np.dtype
    size: int

    @property
    def full(self) -> bool:
        """Whether the side's token cap is reached."""
        ...

    def add(self, ids: np.ndarray, trained: np.ndarray) -> None:
        """Append one encoded document."""
        ...

    def append(self, tokens: np.ndarray, flags: np.ndarray) -> None:
        """Append a piece of the token stream (its first token begins a document)."""
        ...

    def close(self) -> None:
        """Close the files."""
        ...


def is_val_document(key: str, val_fraction: float) -> bool:
    """Whether the document with this key is held out (a hash of the key, so stable everywhere)."""
    return zlib.crc32(key.encode("utf-8")) % 10_000 < val_fraction * 10_000


def held_out_tail(num_tokens: int, seq_len: int, val_fraction: float) -> int:
    """Tokens held out at the end of a corpus of few documents: the share, at least one sequence, at most half."""
    return min(max(round(num_tokens * val_fraction), seq_len + 1), num_tokens // 2)


class Splitter:
    """Sends each document to its side: by val_path, by a hash of its key, or (few documents) by position."""

    def __init__(self, sides: dict[str, Side], head: Side | None, val_fraction: float) -> None:
        self.sides, self.head, self.val_fraction = sides, head, val_fraction
        self.hashing = head is not None  # false with data.val_path: every document of data.path trains
        self.pending: list[tuple[str, int]] = []  # (key, tokens) of the documents in the head, in order
        self.num_documents = {"train": 0, "val": 0}

    @property
    def few_documents(self) -> bool:
        """Whether data.path ended before HASH_SPLIT_MIN_DOCUMENTS documents (the tail rule applies)."""
        return self.head is not None

    def add(self, side: str, key: str, ids: np.ndarray, trained: np.ndarray) -> bool:
        """Place one encoded document; False once every side is full (tokenizing may stop)."""
        if side == "train" and self.head is not None:
            self.head.add(ids, trained)
            self.pending.append((key, len(ids)))
            return len(self.pending) < HASH_SPLIT_MIN_DOCUMENTS or self._route_head()
        if side == "train" and self.hashing and is_val_document(key, self.val_fraction):
            side = "val"
        if self.sides[side].full:
            return not all(s.full for s in self.sides.values())
        self.sides[side].add(ids, trained)
        self.num_documents[side] += 1
        return True

    def _head_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The head's tokens and flags; its files are removed and the head is gone."""
        head = self.head
        assert head is not None
        head.close()
        tokens = np.fromfile(head.tokens_path, dtype=head.dtype)
        flags = np.fromfile(head.flags_path, dtype=np.uint8)
        os.remove(head.tokens_path)
        os.remove(head.flags_path)
        self.head = None
        return tokens, flags

    def _route_head(self) -> bool:
        """Enough documents for the hash rule: send the waiting ones to their sides, in order."""
        tokens, flags = self._head_arrays()
        at = 0
        for key, size in self.pending:
            side = "val" if is_val_document(key, self.val_fraction) else "train"
            piece = slice(at, at + size)
            at += size
            if self.sides[side].full:
                if all(s.full for s in self.sides.values()):
                    return False
                continue
            if size:
                self.sides[side].append(tokens[piece], flags[piece])
            self.num_documents[side] += 1
        return True

    def split_tail(self, max_tokens: int | None, seq_len: int) -> None:
        """Few documents: the stream (cut at max_tokens) trains, but for its held-out tail."""
        tokens, flags = self._head_arrays()
        tokens, flags = tokens[:max_tokens], flags[:max_tokens]
        cut = len(tokens) - held_out_tail(len(tokens), seq_len, self.val_fraction)
        if cut:
            self.sides["train"].append(tokens[:cut], flags[:cut])
        if cut < len(tokens):
            self.sides["val"].append(tokens[cut:], flags[cut:])
        ends = np.cumsum([size for _, size in self.pending])
        starts = ends - [size for _, size in self.pending]
        self.num_documents = {  # the document the cut falls in counts on both sides
            "train": int(np.count_nonzero(starts < cut)),
            "val": int(np.count_nonzero(ends > cut)),
        }
