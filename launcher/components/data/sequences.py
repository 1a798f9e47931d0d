"""Sequences and samplers: packed sequences with document boundaries, and the resumable, rank-aware stream.

Labels are the next tokens, -100 where that token is not trained (a prompt) or, with document
masking, where it begins a new document (nothing before it in the row may predict it). With
document masking a row also carries `position_ids` that restart at every document start; the
model turns them into a block-diagonal causal mask, so a packed row gives each document exactly
the logits it would get alone.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypedDict

import torch

from launcher.components.data.tokens import START, TRAINED, TokenStore

if TYPE_CHECKING:
    from typing_extensions import Unpack


def labels_and_positions(
    tokens: torch.Tensor, flags: torch.Tensor, *, document_mask: bool
) -> dict[str, torch.Tensor]:
    """input_ids, labels (and position_ids with document masking) of rows of seq_len + 1 tokens and flags."""
    inputs, targets = tokens[:, :-1].long(), tokens[:, 1:].long()
    keep = (flags[:, 1:] & TRAINED) != 0
    batch = {"input_ids": inputs}
    if document_mask:
        keep &= (flags[:, 1:] & START) == 0
        starts = (flags[:, :-1] & START) != 0
        starts[:, 0] = True  # a row begins a document for attention, wherever it cuts
        columns = torch.arange(inputs.shape[1]).expand_as(inputs)
        last_start = torch.where(starts, columns, torch.zeros_like(columns)).cummax(dim=1).values
        batch["position_ids"] = columns - last_start
    batch["labels"] = torch.where(keep, targets, torch.full_like(targets, -100))
    return batch


class PackedSequences:
    """A token stream cut into back-to-back sequences of seq_len inputs (+1 token for the last label)."""

    def __init__(self, store: TokenStore, seq_len: int, *, document_mask: bool = True) -> None:
        if store.tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(store.tokens.shape)}.")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}.")
        self.tokens, self.flags = store.tokens, store.flags
        self.seq_len = seq_len
        self.document_mask = document_mask
        self._offsets = torch.arange(seq_len + 1)

    def __len__(self) -> int:
        return max((len(self.tokens) - 1) // self.seq_len, 0)

    def batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sequences `indices`: input_ids, next-token labels (and position_ids), all int64 [B, seq_len]."""
        positions = indices.reshape(-1, 1).long() * self.seq_len + self._offsets
        return labels_and_positions(
            self.tokens[positions], self.flags[positions], document_mask=self.document_mask
        )


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch), so that no two pairs share an order."""
    digest = hashlib.sha256(f"{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class _Seed(TypedDict):
    """The one placement keyword without a default."""

    seed: int


class Placement(_Seed, total=False):
    """The keywords every sampler takes: a seed, this rank (default 0) of world_size (1), grad_accum_steps (1)."""

    rank: int
    world_size: int
    grad_accum_steps: int


class EpochStream(ABC):
    """What every sampler shares: its Placement, an (epoch, offset) position, next_batch/skip, its state.

    A subclass says how an epoch is planned (`_plan_epoch`, kept in `_plan`) and how the plan hands
    out this rank's next indices (`_next_indices`, calling `_next_epoch` when the epoch runs out),
    and calls `_begin` once it is set up. The position is rank-independent: one state dict resumes
    every rank.
    """

    _plan: object

    def __init__(
        self,
        dataset: PackedSequences,
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        grad_accum_steps: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}.")
        self.dataset, self.seed = dataset, seed
        self.rank, self.world_size, self.grad_accum_steps = rank, world_size, grad_accum_steps

    def _begin(self) -> None:
        self._epoch, self._offset = 0, 0
        self._plan = self._plan_epoch(0)

    @abstractmethod
    def _plan_epoch(self, epoch: int) -> object:
        """The epoch's plan: an order of sequences, or of batches."""

    @abstractmethod
    def _next_indices(self) -> torch.Tensor:
        """This rank's indices of the next micro batch; advances the position."""

    def _next_epoch(self) -> None:
        self._epoch += 1
        self._offset = 0
        self._plan = self._plan_epoch(self._epoch)

    @property
    def epoch(self) -> int:
        """Epochs begun so far, counting from 0."""
        return self._epoch

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's part of the next global micro batch (input_ids, labels, [position_ids]; int64 [B, T])."""
        return self.dataset.batch(self._next_indices())

    def skip(self) -> None:
        """Move past the next micro batch without building it (loader workers share out the batches)."""
        self._next_indices()

    def state_dict(self) -> dict[str, int]:
        """The position in the data, identical on every rank."""
        return {"epoch": self._epoch, "offset": self._offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position `state_dict` returned."""
        self._epoch, self._offset = int(state["epoch"]), int(state["offset"])
        self._plan = self._plan_epoch(self._epoch)


class BatchStream(EpochStream):
    """Seeded, rank-aware, resumable sampler of training micro batches.

    Each epoch is a seeded permutation of all sequences. A call of `next_batch` consumes the next
    global micro batch (micro_batch_size * world_size indices) and returns this rank's slice, so
    W ranks see together exactly what one process with micro batch B * W sees. An epoch ends when
    fewer indices remain than one optimizer step needs (grad_accum_steps global micro batches), so
    accumulating k micro batches of B also sees exactly the sequences of one micro batch of k * B.
    """

    def __init__(
        self, dataset: PackedSequences, *, micro_batch_size: int, **placement: Unpack[Placement]
    ) -> None:
        super().__init__(dataset, **placement)
        world_size, grad_accum_steps = self.world_size, self.grad_accum_steps
        if micro_batch_size <= 0 or grad_accum_steps <= 0:
            raise ValueError("micro_batch_size and grad_accum_steps must be positive.")
        self.micro_batch_size = micro_batch_size
        self.global_micro_batch = micro_batch_size * world_size
        self.step_size = self.global_micro_batch * grad_accum_steps
        if len(dataset) < self.step_size:
            raise ValueError(
                f"the training data holds {len(dataset)} sequences of {dataset.seq_len} tokens, fewer than one "
                f"optimizer step needs ({micro_batch_size} per micro batch x {world_size} ranks x "
                f"{grad_accum_steps} accumulated). Lower train.micro_batch_size or data.seq_len, or use more data."
            )
        self._begin()

    def _permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
        return torch.randperm(len(self.dataset), generator=generator)

    def _plan_epoch(self, epoch: int) -> torch.Tensor:
        return self._permutation(epoch)

    def _begin(self) -> None:
        self._micro_batches_taken = 0
        super()._begin()

    def _next_indices(self) -> torch.Tensor:
        # A step's start by micro batches counted, not by the offset: a checkpoint written with another
        # global batch leaves an offset that is no multiple of this run's step, and the end of the epoch
        # must still be tested before every step.
        at_step_start = self._micro_batches_taken % self.grad_accum_steps == 0
        if at_step_start and self._offset + self.step_size > len(self._plan):
            self._next_epoch()
        start = self._offset + self.rank * self.micro_batch_size
        indices = self._plan[start : start + self.micro_batch_size]
        self._offset += self.global_micro_batch
        self._micro_batches_taken += 1
        return indices

    def state_dict(self) -> dict[str, int]:
        """The position in the data, identical on every rank, with the micro batches taken of the current step."""
        return {**super().state_dict(), "step_micro": self._micro_batches_taken % self.grad_accum_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position `state_dict` returned (a step's start where it says none, as checkpoints are)."""
        super().load_state_dict(state)
        self._micro_batches_taken = int(state.get("step_micro", 0))


def check_held_out(dataset: PackedSequences, world_size: int) -> None:
    """Raise unless every rank gets a held-out sequence (the launching process refuses this first: the last guard)."""
    if len(dataset) < world_size:
        raise ValueError(
            f"the held-out data holds {len(dataset)} sequences of {dataset.seq_len} tokens, fewer than the "
            f"{world_size} ranks. Raise data.val_fraction or lower data.seq_len."
        )


def val_batches(
    dataset: PackedSequences, *, micro_batch_size: int, max_batches: int, rank: int = 0, world_size: int = 1
) -> Iterator[dict[str, torch.Tensor]]:
    """Up to max_batches held-out micro batches in order, sharded over ranks like BatchStream.

    Every rank yields the same number of equally shaped batches (collective strategies need
    that); when the data holds fewer sequences than one global micro batch, batches shrink.
    """
    check_held_out(dataset, world_size)
    batch_size = min(micro_batch_size, len(dataset) // world_size)
    num_batches = min(max_batches, len(dataset) // (batch_size * world_size))
    for j in range(num_batches):
        start = (j * world_size + rank) * batch_size
        yield dataset.batch(torch.arange(start, start + batch_size))
