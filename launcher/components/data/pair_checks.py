"""Which preference pairs (kto examples) of a token store can train, and why the others cannot.

A pair trains nothing when a side keeps no response token inside data.seq_len + 1 tokens (its prompt
fills them: the loss is ln 2 and every reward 0 at every step), when a side is empty, or when both
sides are the same tokens (no margin can grow). PairDocuments leaves such documents out, and the
launching process (front/pair_data.py) counts them with the same function before launch: it refuses
the run when more than DROP_SHARE of the pairs are affected and names how many it drops otherwise.
Pure numpy over one document's spans: no torch, so the launching process reads it cheaply.
"""

from __future__ import annotations

import numpy as np

from launcher.components.data.pairs import REJECTED, TRAINED

DROP_SHARE = 0.05
"""Up to this share of the pairs (kto examples) that cannot train are dropped with a console line; more is refused."""
DEFECTS = ("empty", "identical", "prompt")
"""Why a pair cannot train, in the order they are judged."""


def spans(flags: np.ndarray, begin: int, end: int, *, kto: bool) -> tuple[int, int, int] | None:
    """(begin, middle, end) cut of one document: a pair's rejected side (kto: its completion) starts at
    middle; None for a pair the cache's cap cut short (no single REJECTED bit after the first token)."""
    cut = np.flatnonzero(flags[begin:end] & (TRAINED if kto else REJECTED))
    if kto:
        return begin, begin + (int(cut[0]) if len(cut) else end - begin), end
    if len(cut) != 1 or int(cut[0]) == 0:
        return None
    return begin, begin + int(cut[0]), end


def _keeps_a_label(flags: np.ndarray, begin: int, end: int, seq_len: int) -> bool:
    """Whether a row of flags[begin:end], cut at seq_len + 1 tokens, has a trained label (not its first token)."""
    return bool(np.any(flags[begin + 1 : min(end, begin + seq_len + 1)] & TRAINED))


def defect(
    tokens: np.ndarray, flags: np.ndarray, cut: tuple[int, int, int], seq_len: int, *, kto: bool
) -> str | None:
    """Why the document cut as (begin, middle, end) trains nothing (one of DEFECTS), or None when it trains."""
    begin, middle, end = cut
    rows = [(begin, end)] if kto else [(begin, middle), (middle, end)]
    if any(not np.any(flags[b:e] & TRAINED) for b, e in rows):
        return "empty"
    if not kto and np.array_equal(tokens[begin:middle], tokens[middle:end]):
        return "identical"
    if not all(_keeps_a_label(flags, b, e, seq_len) for b, e in rows):
        return "prompt"
    return None


def prompt_length(flags: np.ndarray, cut: tuple[int, int, int]) -> int:
    """Tokens before the first response token of the document's first side (its prompt, with BOS)."""
    begin, _, end = cut
    trained = np.flatnonzero(flags[begin:end] & TRAINED)
    return int(trained[0]) if len(trained) else end - begin
