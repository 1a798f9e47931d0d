"""Loader processes: micro batches prepared ahead of the loop by `data.num_workers` workers.

Each worker holds a copy of the stream at the loop's position and builds every num_workers-th
micro batch after it (skipping the others cheaply), so torch's DataLoader, which takes workers'
outputs in turn, hands the loop exactly the sequence the stream alone would. The loop's position
is tracked by a shadow stream that only skips, so `state_dict` is always the position after the
last batch the loop took, and resuming stays exact. On CUDA batches come in pinned memory.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from launcher.groups.batching import Batches


class _Shares(IterableDataset):
    """The stream from its current position, each worker building its share of the micro batches."""

    def __init__(self, stream: Batches) -> None:
        self.stream = stream

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        stream = copy.copy(self.stream)  # shares the tokens; the position is its own
        index = 0
        while True:
            if index % num_workers == worker:
                yield stream.next_batch()
            else:
                stream.skip()
            index += 1


class PrefetchedBatches:
    """A Batches stream whose micro batches are built by worker processes ahead of the loop."""

    def __init__(
        self, stream: Batches, *, num_workers: int, pin_memory: bool, prefetch_factor: int = 4
    ) -> None:
        self._shadow = stream
        self._options: dict[str, Any] = {
            "batch_size": None, "num_workers": num_workers, "pin_memory": pin_memory,
            "prefetch_factor": prefetch_factor, "persistent_workers": False,
        }  # fmt: skip
        self._batches: Iterator[dict[str, torch.Tensor]] | None = None

    @property
    def epoch(self) -> int:
        """Epochs begun so far by the batches the loop took."""
        return self._shadow.epoch

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next micro batch, built ahead by a worker."""
        if self._batches is None:
            self._batches = iter(DataLoader(_Shares(copy.copy(self._shadow)), **self._options))
        batch = next(self._batches)
        self._shadow.skip()
        return batch

    def skip(self) -> None:
        """Move past the next micro batch."""
        self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """The position after the last micro batch the loop took."""
        return self._shadow.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from `state`: the workers restart there."""
        self._shadow.load_state_dict(state)
        self._batches = None
