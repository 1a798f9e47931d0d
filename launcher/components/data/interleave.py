"""The deterministic weighted interleave of a mixture's sequences: rank-aware, resumable, counter-based.

Draw j (the j-th training sequence of the run, over all ranks) comes from source
`choose(seed, j, weights)`: a uniform number from a generator seeded by (train.seed, j's block of
BLOCK_DRAWS) against the cumulative weights. The choice is a pure function of (seed, j), so it
does not depend on the micro batch size, the number of ranks or accumulation: W ranks with micro
batch B see together exactly what one process with micro batch B * W sees, and a position is O(1)
to restore. Source k's n-th sequence is entry n % len_k of its epoch n // len_k's permutation
(seeded by train.seed, the source's name and that epoch), so a source that runs out starts its next
epoch, reshuffled, in the middle of a batch, while the others go on; no sequence is dropped.

The position is (draws made, sequences drawn from each source), identical on every rank: every
rank computes the whole global micro batch's choices and takes its own slice.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from launcher.components.data.sequences import PackedSequences, labels_and_positions

BLOCK_DRAWS = 4096
"""Draws per generator block: the j-th choice needs only block j // BLOCK_DRAWS."""


def _seed(*parts: object) -> int:
    """A 63-bit generator seed from a tuple of parts (so that no two tuples share a stream)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def thresholds(weights: list[float]) -> torch.Tensor:
    """The cumulative normalized weights (float64), the last exactly 1."""
    w = torch.tensor(weights, dtype=torch.float64)
    cumulative = torch.cumsum(w / w.sum(), dim=0)
    cumulative[-1] = 1.0
    return cumulative


def choose_block(seed: int, block: int, cumulative: torch.Tensor) -> torch.Tensor:
    """The source index of each draw of block `block` (BLOCK_DRAWS int64 values)."""
    generator = torch.Generator().manual_seed(_seed(seed, "mixture", block))
    uniform = torch.rand(BLOCK_DRAWS, generator=generator, dtype=torch.float64)
    return torch.searchsorted(cumulative, uniform, right=True).clamp_(max=len(cumulative) - 1)


def choose(seed: int, start: int, count: int, cumulative: torch.Tensor) -> torch.Tensor:
    """The source index of draws start .. start + count - 1."""
    first, last = start // BLOCK_DRAWS, (start + count - 1) // BLOCK_DRAWS
    blocks = [choose_block(seed, b, cumulative) for b in range(first, last + 1)] if count else []
    joined = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.int64)
    begin = start - first * BLOCK_DRAWS
    return joined[begin : begin + count]


def source_order(seed: int, name: str, epoch: int, length: int) -> torch.Tensor:
    """Source `name`'s order of its `length` sequences in `epoch`."""
    generator = torch.Generator().manual_seed(_seed(seed, "source", name, epoch))
    return torch.randperm(length, generator=generator)


@dataclass(frozen=True)
class HeldOut:
    """One source's held-out sequences, evaluated on their own (`eval_loss/<name>`)."""

    name: str
    sequences: PackedSequences
    weight: float
    """Its share in the mixture's `eval_loss` (the weighted mean of the sources')."""


class MixtureStream:
    """Seeded, rank-aware, resumable micro batches interleaving several sources' packed sequences by weight."""

    def __init__(
        self,
        datasets: dict[str, PackedSequences],
        weights: dict[str, float],
        *,
        micro_batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}.")
        empty = [name for name, data in datasets.items() if len(data) == 0]
        if empty:
            raise ValueError(
                f"source {empty[0]} holds no training sequence of {datasets[empty[0]].seq_len + 1} tokens. Give it "
                "more data, lower data.seq_len, or drop it from data.sources."
            )
        self.names = list(datasets)
        self.datasets = [datasets[name] for name in self.names]
        self.lengths = [len(data) for data in self.datasets]
        self.cumulative = thresholds([weights[name] for name in self.names])
        self.micro_batch_size, self.seed, self.rank = micro_batch_size, seed, rank
        self.global_micro_batch = micro_batch_size * world_size
        self._draws, self._seen = 0, (0,) * len(self.names)
        self._orders: dict[tuple[int, int], torch.Tensor] = {}
        self._block: tuple[int, torch.Tensor] | None = None

    def __copy__(self) -> MixtureStream:
        """A stream at the same position with its own cache of source orders (copies move independently)."""
        clone = object.__new__(MixtureStream)
        clone.__dict__.update(self.__dict__)
        clone._orders = {}
        return clone

    @property
    def epoch(self) -> int:
        """Passes over the whole mixture: the fewest passes any source has completed."""
        return min(seen // length for seen, length in zip(self._seen, self.lengths, strict=True))

    def _order(self, k: int, epoch: int) -> torch.Tensor:
        key = (k, epoch)
        if key not in self._orders:
            self._orders[key] = source_order(self.seed, self.names[k], epoch, self.lengths[k])
        return self._orders[key]

    def _choices(self, start: int, count: int) -> torch.Tensor:
        """choose(), with the last block kept: a block serves BLOCK_DRAWS / global micro batch batches."""
        block = start // BLOCK_DRAWS
        if (start + count - 1) // BLOCK_DRAWS != block:
            return choose(self.seed, start, count, self.cumulative)
        if self._block is None or self._block[0] != block:
            self._block = (block, choose_block(self.seed, block, self.cumulative))
        begin = start - block * BLOCK_DRAWS
        return self._block[1][begin : begin + count]

    def _advance(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Consume one global micro batch: this rank's (source, occurrence number) per row."""
        choices = self._choices(self._draws, self.global_micro_batch)
        onehot = torch.nn.functional.one_hot(choices, len(self.names))
        before = (onehot.cumsum(0) - onehot).gather(1, choices[:, None]).squeeze(1)
        occurrence = torch.tensor(self._seen)[choices] + before
        mine = slice(self.rank * self.micro_batch_size, (self.rank + 1) * self.micro_batch_size)
        for k, epoch in list(self._orders):  # orders of epochs each source had left behind before this batch
            if epoch < self._seen[k] // self.lengths[k]:
                del self._orders[(k, epoch)]
        self._draws += self.global_micro_batch
        self._seen = tuple(int(s) for s in torch.tensor(self._seen) + onehot.sum(0))
        return choices[mine], occurrence[mine]

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's part of the next global micro batch (rows in draw order; input_ids, labels, [position_ids])."""
        sources, occurrences = self._advance()
        tokens, flags, rows = [], [], []
        for k in sources.unique().tolist():
            where = torch.nonzero(sources == k).flatten()
            data, length = self.datasets[k], self.lengths[k]
            indices = torch.stack(
                [self._order(k, o // length)[o % length] for o in occurrences[where].tolist()]
            )
            positions = indices[:, None] * data.seq_len + torch.arange(data.seq_len + 1)
            tokens.append(data.tokens[positions].long())
            flags.append(data.flags[positions])
            rows.append(where)
        order = torch.argsort(torch.cat(rows))  # back to draw order
        return labels_and_positions(
            torch.cat(tokens)[order], torch.cat(flags)[order], document_mask=self.datasets[0].document_mask
        )

    def skip(self) -> None:
        """Move past the next micro batch without building it."""
        self._advance()

    def state_dict(self) -> dict[str, int]:
        """The position: draws made and sequences drawn per source (`seen/<name>`), identical on every rank."""
        return {"draws": self._draws, **{f"seen/{n}": s for n, s in zip(self.names, self._seen, strict=True)}}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position `state_dict` returned (a source new since then starts at its beginning)."""
        self._draws = int(state["draws"])
        self._seen = tuple(int(state.get(f"seen/{name}", 0)) for name in self.names)
        self._orders = {}


def source_epochs(state: dict[str, int], lengths: dict[str, int]) -> dict[str, int]:
    """`epoch/<name>`: passes each source has completed at a position (metrics records)."""
    return {f"epoch/{name}": int(state.get(f"seen/{name}", 0)) // length for name, length in lengths.items()}
