"""Batches of whole documents for variable-length data: padded, grouped by length, or by a token budget;
and preference pairs (or kto examples) as whole sides, chosen rows then rejected rows (`PairDocuments`).

With `data.packing=false` every document (ended by the 0 separator byte) becomes one training
sequence; a document longer than `data.seq_len` is cut into several. Batches are padded to
their longest sequence with labels -100 on the padding, so the loop's token count (and the loss
normalized by it) covers real tokens only. Padding goes on the right of a causal model: no real
token attends to it, and each document starts at position 0.

Every stream here has BatchStream's interface (next_batch, state_dict, load_state_dict, epoch)
and its contracts: the order of an epoch is a pure function of (seed, epoch) computed alike on
every rank, a call of next_batch consumes one global micro batch and returns this rank's part,
and the position (epoch, offset) is rank-independent, so one state dict resumes every rank
exactly. With token-budget batches the number of sequences per batch varies, but the number of
batches does not: every rank gets exactly one batch per next_batch call, and an optimizer step
is always grad_accum_steps calls on every rank, so ranks stay in step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from launcher.components.data.pair_checks import judge
from launcher.components.data.pairs import UNDESIRABLE
from launcher.components.data.sequences import (
    BatchStream,
    EpochStream,
    PackedSequences,
    Placement,
    _epoch_seed,
    labels_and_positions,
)
from launcher.components.data.tokens import START, TRAINED, Corpus, TokenStore

if TYPE_CHECKING:
    from typing_extensions import Unpack


class Batches(Protocol):
    """A resumable stream of training micro batches (every stream here, packed or not)."""

    @property
    def epoch(self) -> int:
        """Epochs begun so far, counting from 0."""
        ...

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's part of the next global micro batch: input_ids, labels (and position_ids)."""
        ...

    def skip(self) -> None:
        """Move past the next micro batch without building it."""
        ...

    def state_dict(self) -> dict[str, int]:
        """The position in the data, identical on every rank."""
        ...

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position `state_dict` returned."""
        ...


GROUP_SIZE = 32
"""Global micro batches per length group: sorting happens inside groups of this many, so order stays random."""


class Documents:
    """The documents of a token store as variable-length sequences (at most seq_len inputs each)."""

    def __init__(self, store: TokenStore, seq_len: int) -> None:
        starts_at = torch.nonzero(store.flags & START).flatten()
        bounds = torch.cat(
            [torch.tensor([0]), starts_at, torch.tensor([len(store.tokens)])]
        ).unique_consecutive()
        starts, lengths = [], []
        for begin, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            for chunk in range(begin, end - 1, seq_len):  # each chunk: up to seq_len inputs + 1 label
                starts.append(chunk)
                lengths.append(min(seq_len + 1, end - chunk))
        self.tokens, self.flags = store.tokens, store.flags
        self.seq_len = seq_len
        self.starts = torch.tensor(starts, dtype=torch.int64)
        self.lengths = torch.tensor(lengths, dtype=torch.int64) - 1  # inputs per sequence (>= 1)

    def __len__(self) -> int:
        return len(self.starts)

    def batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sequences `indices`, right-padded to the longest: input_ids (pad 0) and labels (pad -100)."""
        indices = indices.reshape(-1).long()
        width = int(self.lengths[indices].max()) if len(indices) else 0
        tokens = torch.zeros((len(indices), width + 1), dtype=torch.int64)
        flags = torch.zeros((len(indices), width + 1), dtype=torch.uint8)  # padding: never trained
        for row, i in enumerate(indices.tolist()):
            start, n = int(self.starts[i]), int(self.lengths[i])
            tokens[row, : n + 1] = self.tokens[start : start + n + 1].long()
            flags[row, : n + 1] = self.flags[start : start + n + 1]
        flags[:, 1:] &= ~torch.tensor(START, dtype=torch.uint8)  # one document per row: nothing to cut
        return labels_and_positions(tokens, flags, document_mask=False)


class PairDocuments:
    """The pairs (or kto examples) of a token store, read back as batches of whole, truncated sides.

    A kto batch of B examples holds 2B rows: the examples, then B KL rows, example i's prompt with the
    completion of example i - 1 (cyclically, as TRL's KTO collator pairs them) for KTO's reference point.
    """

    def __init__(self, store: TokenStore, seq_len: int, *, kto: bool) -> None:
        flags = store.flags
        # kto: (prompt, completion), the completion from the first trained token; a pair the cache's cap cut
        # short, or one that trains nothing within seq_len (pair_checks: counted before launch), is left out
        kept = judge(store.tokens.numpy(), flags.numpy(), seq_len, kto=kto).kept()
        sides = [[(begin, middle), (middle, end)] for begin, middle, end in kept.tolist()]
        labels = ((flags.numpy()[kept[:, 0]] & UNDESIRABLE) == 0).tolist() if kto else []
        self.tokens, self.flags, self.seq_len, self.kto = store.tokens, flags, seq_len, kto
        self.sides = sides
        self.labels = torch.tensor(labels, dtype=torch.int64)
        longest = [max(e - b for b, e in s) for s in sides] if not kto else [s[1][1] - s[0][0] for s in sides]
        self.lengths = torch.tensor([min(n, seq_len + 1) - 1 for n in longest], dtype=torch.int64)
        self.ref_logps: torch.Tensor | None = None
        """[len, sides] reference log-probs (objective.reference=precompute): batches carry them as `ref_logps`."""

    def __len__(self) -> int:
        return len(self.sides)

    def _rows(self, picked: list[int]) -> list[list[tuple[int, int]]]:
        """Each row as the token spans it joins: chosen then rejected sides; kto: examples, then KL rows."""
        if not self.kto:
            return [[self.sides[i][k]] for k in (0, 1) for i in picked]
        examples = [[self.sides[i][0], self.sides[i][1]] for i in picked]
        shifted = picked[-1:] + picked[:-1]
        return examples + [[self.sides[i][0], self.sides[j][1]] for i, j in zip(picked, shifted, strict=True)]

    def batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows of whole sides, right-padded (input 0, label -100): chosen rows then rejected rows (kto: + kto_label)."""
        picked = indices.reshape(-1).long().tolist()
        rows = [
            (torch.cat([self.tokens[b:e] for b, e in spans]), torch.cat([self.flags[b:e] for b, e in spans]))
            for spans in self._rows(picked)
        ]
        width = max((min(len(t), self.seq_len + 1) for t, _ in rows), default=1)
        tokens = torch.zeros((len(rows), width), dtype=torch.int64)
        flags = torch.zeros((len(rows), width), dtype=torch.uint8)
        for row, (ids, bits) in enumerate(rows):
            n = min(len(ids), self.seq_len + 1)
            tokens[row, :n] = ids[:n].long()
            flags[row, :n] = bits[:n] & TRAINED
        batch = labels_and_positions(tokens, flags, document_mask=False)
        index = torch.tensor(picked, dtype=torch.int64)
        if self.kto:
            batch["kto_label"] = self.labels[index]
        if self.ref_logps is not None:  # the rows' order: every chosen side, then every rejected side
            batch["ref_logps"] = self.ref_logps[index].T.reshape(-1)
        return batch


def grouped_order(lengths: torch.Tensor, order: torch.Tensor, group: int) -> torch.Tensor:
    """`order` with each run of `group` indices sorted by length, longest first (stable)."""
    parts = []
    for chunk in order.split(group):
        keys = lengths[chunk]
        parts.append(chunk[torch.sort(keys, descending=True, stable=True).indices])
    return torch.cat(parts) if parts else order


class LengthGroupedStream(BatchStream):
    """BatchStream over documents whose epoch order puts sequences of similar length in one batch.

    The seeded permutation is cut into groups of GROUP_SIZE global micro batches and each group is
    sorted by length, so a micro batch holds similar lengths (little padding) while the order of
    groups stays random.
    """

    def _permutation(self, epoch: int) -> torch.Tensor:
        order = super()._permutation(epoch)
        return grouped_order(self.dataset.lengths, order, GROUP_SIZE * self.global_micro_batch)


class TokenBudgetStream(EpochStream):
    """Micro batches of as many documents as fit `max_tokens` padded tokens, rank-aware and resumable.

    Each epoch: a seeded permutation, grouped by length, cut greedily into batches whose
    (sequences x longest) stays within the budget; W consecutive batches form one global micro
    batch (rank r takes the r-th), and global micro batches are shuffled. The epoch ends when fewer
    than one optimizer step's worth (grad_accum_steps global micro batches) remain.
    """

    def __init__(self, dataset: Documents, *, max_tokens: int, **placement: Unpack[Placement]) -> None:
        super().__init__(dataset, **placement)
        if max_tokens < dataset.seq_len:
            raise ValueError(f"max_tokens ({max_tokens}) must hold one sequence of {dataset.seq_len} tokens.")
        self.max_tokens = max_tokens
        self._begin()
        if (
            self.batches_per_epoch < self.grad_accum_steps
        ):  # refused before launch (front/data_sizes.py): a last guard
            raise ValueError(
                f"the training data makes {len(self._plan)} global micro batches of at most {max_tokens} tokens "
                f"per rank, fewer than one optimizer step needs ({self.grad_accum_steps}). Lower "
                "data.max_tokens_per_batch or train.grad_accum_steps, or use more data."
            )

    @property
    def batches_per_epoch(self) -> int:
        """Global micro batches of the current epoch (an optimizer step takes grad_accum_steps of them)."""
        return len(self._plan)

    def _cut(self, order: torch.Tensor) -> list[torch.Tensor]:
        """Greedy batches along `order` within the token budget (a batch always takes one sequence)."""
        batches, start, longest = [], 0, 0
        lengths = self.dataset.lengths[order].tolist()
        for i, n in enumerate(lengths):
            longest_with = max(longest, n)
            if i > start and longest_with * (i - start + 1) > self.max_tokens:
                batches.append(order[start:i])
                start, longest_with = i, n
            longest = longest_with
        if start < len(order):
            batches.append(order[start:])
        return batches

    def _plan_epoch(self, epoch: int) -> list[list[torch.Tensor]]:
        """The epoch's global micro batches, each a list of world_size per-rank index tensors."""
        generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
        order = torch.randperm(len(self.dataset), generator=generator)
        order = grouped_order(self.dataset.lengths, order, max(len(order) // 16, 1))
        per_rank = self._cut(order)
        w = self.world_size
        global_batches = [per_rank[i : i + w] for i in range(0, len(per_rank) - w + 1, w)]
        shuffle = torch.randperm(len(global_batches), generator=generator).tolist()
        return [global_batches[i] for i in shuffle]

    def _next_indices(self) -> torch.Tensor:
        step = self.grad_accum_steps
        if self._offset % step == 0 and self._offset + step > len(self._plan):
            self._next_epoch()
        indices = self._plan[self._offset][self.rank]
        self._offset += 1
        return indices


def build_stream(
    corpus: Corpus,
    *,
    seq_len: int,
    packing: bool,
    document_mask: bool = True,
    batching: str,
    max_tokens_per_batch: int | None,
    micro_batch_size: int,
    grad_accum_steps: int,
    seed: int,
    rank: int,
    world_size: int,
    pairs: str | None = None,
    ref_logps: torch.Tensor | None = None,
) -> Batches:
    """The training batch stream the data settings ask for (packed sequences by default; `pairs`:
    data.format preference or kto, read by launcher.components.data.pairs; `ref_logps`: their precomputed
    reference log-probs)."""
    common = Placement(seed=seed, rank=rank, world_size=world_size, grad_accum_steps=grad_accum_steps)
    if pairs is not None:  # preference pairs or kto examples: whole sides, never packed
        dataset = PairDocuments(corpus.train, seq_len, kto=pairs == "kto")
        dataset.ref_logps = ref_logps
        return BatchStream(dataset, micro_batch_size=micro_batch_size, **common)
    if packing:
        return BatchStream(
            PackedSequences(corpus.train, seq_len, document_mask=document_mask),
            micro_batch_size=micro_batch_size,
            **common,
        )
    documents = Documents(corpus.train, seq_len)
    if batching == "token_budget":
        return TokenBudgetStream(documents, max_tokens=int(max_tokens_per_batch or 0), **common)
    stream_type = LengthGroupedStream if batching == "group_by_length" else BatchStream
    return stream_type(documents, micro_batch_size=micro_batch_size, **common)
