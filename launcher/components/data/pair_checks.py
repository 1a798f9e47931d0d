"""Which preference pairs (kto examples) of a token store can train, and why the others cannot.

A pair trains nothing when a side keeps no response token inside data.seq_len + 1 tokens (its prompt
fills them: the loss is ln 2 and every reward 0 at every step), when a side is empty, or when both
sides are the same tokens (no margin can grow). PairDocuments leaves such documents out, and the
launching process (front/pair_data.py) counts them with the same function before launch: it refuses
the run when more than DROP_SHARE of the pairs are affected and names how many it drops otherwise.
Pure numpy over whole arrays (about 0.2 s for 50,000 pairs): no torch, so the launching process reads it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from launcher.components.data.pairs import REJECTED, TRAINED
from launcher.components.data.tokens import START

DROP_SHARE = 0.05
"""Up to this share of the pairs (kto examples) that cannot train are dropped with a console line; more is refused."""
DEFECTS = ("empty", "identical", "prompt")
"""Why a pair cannot train, in the order they are judged (Judged.defect holds the index + 1; 0: it trains)."""


@dataclass(frozen=True)
class Judged:
    """Every whole document of a store, cut into its two sides, and whether it trains."""

    cuts: np.ndarray
    """[n, 3] int64 (begin, middle, end): a pair's rejected side (kto: its completion) starts at middle."""
    defect: np.ndarray
    """[n] int8: 0 when the document trains, else 1 + its index in DEFECTS."""

    def kept(self) -> np.ndarray:
        """The cuts of the documents that train."""
        return self.cuts[self.defect == 0]


def _trained_between(csum: np.ndarray, begin: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Trained tokens in [begin, end) for each pair of bounds (csum: the running count, csum[0] = 0)."""
    begin = np.minimum(begin, len(csum) - 1)  # an empty side at the store's end: begin + 1 is past it
    return csum[np.clip(end, begin, len(csum) - 1)] - csum[begin]


def judge(tokens: np.ndarray, flags: np.ndarray, seq_len: int, *, kto: bool) -> Judged:
    """The documents of (tokens, flags) cut into sides and judged at seq_len. Left out entirely: a pair the
    cache's cap cut short (no single REJECTED bit after its first token), and a last document with no trained
    token (the tail split may cut the store's last document short: that is no record's doing)."""
    starts = np.flatnonzero(flags & START).astype(np.int64)
    ends = np.append(starts[1:], len(tokens)).astype(np.int64)
    trained = (flags & TRAINED).astype(bool)
    csum = np.concatenate([[0], np.cumsum(trained, dtype=np.int64)])
    if kto:  # (prompt, completion): the completion from the first trained token
        first = np.searchsorted(np.flatnonzero(trained), starts)
        positions = np.append(np.flatnonzero(trained), len(tokens))
        middles = np.minimum(positions[first], ends)
        valid = np.ones(len(starts), dtype=bool)
    else:
        marks = np.flatnonzero(flags & REJECTED)
        owner = np.searchsorted(starts, marks, side="right") - 1
        count = np.bincount(owner[owner >= 0], minlength=len(starts))
        middles = ends.copy()
        middles[owner[owner >= 0]] = marks[owner >= 0]
        valid = (count == 1) & (middles > starts)
    rows = [(starts, ends)] if kto else [(starts, middles), (middles, ends)]
    empty = np.zeros(len(starts), dtype=bool)
    short = np.zeros(len(starts), dtype=bool)
    for begin, end in rows:
        empty |= _trained_between(csum, begin, end) == 0
        short |= _trained_between(csum, begin + 1, np.minimum(end, begin + seq_len + 1)) == 0
    identical = np.zeros(len(starts), dtype=bool)
    if not kto:
        for i in np.flatnonzero(valid & ~empty & (middles - starts == ends - middles)):
            identical[i] = np.array_equal(tokens[starts[i] : middles[i]], tokens[middles[i] : ends[i]])
    defect = np.where(empty, 1, np.where(identical, 2, np.where(short, 3, 0))).astype(np.int8)
    if len(starts) and empty[-1]:
        valid[-1] = False
    cuts = np.stack([starts, middles, ends], axis=1)[valid]
    return Judged(cuts=cuts, defect=defect[valid])


def prompt_length(flags: np.ndarray, cut: np.ndarray) -> int:
    """Tokens before the first response token of the document's first side (its prompt, with BOS)."""
    begin, _, end = (int(x) for x in cut)
    trained = np.flatnonzero(flags[begin:end] & TRAINED)
    return int(trained[0]) if len(trained) else end - begin
