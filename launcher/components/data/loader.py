"""Loader processes: micro batches prepared ahead of the loop by `data.num_workers` workers.

Each worker holds a copy of the stream at the loop's position and builds every num_workers-th
micro batch after it (skipping the others cheaply), so torch's DataLoader, which takes workers'
outputs in turn, hands the loop exactly the sequence the stream alone would. The loop's position
is tracked by a shadow stream that only skips, so `state_dict` is always the position after the
last batch the loop took, and resuming stays exact. On CUDA batches come in pinned memory.

Without loader processes, a CUDA rank still gets its batches ahead of the loop: one background
thread (BackgroundBatches) builds the next micro batches into pinned memory, so the copy to the
device is asynchronous, while the loop computes. The thread alone moves the stream; each batch
travels with the stream's position after it, so `state_dict` is the position after the last batch
the loop took, exactly as without the thread. On CPU the loop builds its batches itself: there, data
is ~0.2% of a step (docs/performance.md) and a thread would only compete for the same cores.
"""

from __future__ import annotations

import copy
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from launcher.components.data.batching import Batches


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


def _fill(
    owner: weakref.ref[Any],
    stream: Batches,
    pin_memory: bool,
    ready: queue.Queue[tuple[Any, ...]],
    stop: threading.Event,
) -> None:
    """Build batches, each with the stream's position after it, until stopped or the owner is gone.

    The thread holds no reference to its owner: a finished run's batches are collected, and the
    thread ends. An error goes to the loop.
    """
    try:
        while not stop.is_set():
            batch = stream.next_batch()
            if pin_memory:
                batch = {key: value.pin_memory() for key, value in batch.items()}
            item: tuple[Any, ...] = (batch, stream.state_dict(), stream.epoch)
            while not stop.is_set() and owner() is not None:
                try:
                    ready.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            else:
                return
    except Exception as err:  # raised again in the loop's thread, where it belongs
        ready.put((err,))


class BackgroundBatches:
    """A Batches stream whose next micro batches a background thread builds (pinned on CUDA) ahead of the loop."""

    def __init__(self, stream: Batches, *, pin_memory: bool, depth: int = 2) -> None:
        self._stream = stream  # moved by the thread only while it runs
        self._pin_memory = pin_memory
        self._depth = depth
        self._state, self._epoch = stream.state_dict(), stream.epoch
        self._queue: queue.Queue[tuple[Any, ...]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def epoch(self) -> int:
        """Epochs begun so far by the batches the loop took."""
        return self._epoch

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next micro batch, built ahead by the thread."""
        if self._thread is None:
            self._queue, self._stop = queue.Queue(maxsize=self._depth), threading.Event()
            self._thread = threading.Thread(
                target=_fill,
                args=(weakref.ref(self), self._stream, self._pin_memory, self._queue, self._stop),
                name="batches",
                daemon=True,
            )
            self._thread.start()
        assert self._queue is not None
        item = self._queue.get()
        if len(item) == 1:
            raise item[0]
        batch, self._state, self._epoch = item
        return batch

    def skip(self) -> None:
        """Move past the next micro batch."""
        self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """The position after the last micro batch the loop took."""
        return dict(self._state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from `state`: the thread stops, its batches are dropped, and it restarts there."""
        self.close()
        self._stream.load_state_dict(state)
        self._state, self._epoch = self._stream.state_dict(), self._stream.epoch

    def close(self) -> None:
        """Stop the thread; the batches it built ahead are dropped and the stream goes back to the loop's position."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread, self._queue = None, None
            self._stream.load_state_dict(self._state)
