"""The train/eval switch of a schedule-free optimizer, for the loop's evaluation and checkpoints.

Schedule-free AdamW (the `schedulefree` package) keeps the sequence z in its state and leaves the
model holding y, the point gradients are taken at; the weights to evaluate and export are the
average x, which `optimizer.eval()` writes into the model and `optimizer.train()` turns back into
y. Evaluation and every checkpoint run between the two: a checkpoint holds x as the model's weights
(so export and merge read the averaged weights with no extra step) and z in the optimizer state,
with the optimizer in eval mode; the loop switches to train mode before its first step, fresh or
resumed. x -> y is the same arithmetic in a straight run and a resumed one, so resuming is bitwise.
Any other optimizer has no such switch, and these are no-ops for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def has_modes(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` keeps averaged weights apart from the point it trains at (schedule-free)."""
    return callable(getattr(optimizer, "train", None)) and callable(getattr(optimizer, "eval", None))


def train_mode(optimizer: torch.optim.Optimizer) -> None:
    """Put the model's weights where training steps from (y); nothing for other optimizers."""
    if has_modes(optimizer):
        optimizer.train()


def ready_to_load(optimizer: torch.optim.Optimizer) -> None:
    """Train mode before a checkpoint loads, with no empty per-parameter state left by the switch.

    torch's DCP loader steps a fresh optimizer once at lr 0 to create the state it loads into, which
    schedule-free allows in train mode only; and it skips that step (loading no state) where any
    entry exists, empty or not, so the entries the switch leaves behind are dropped.
    """
    if not has_modes(optimizer):
        return
    optimizer.train()
    for param in [param for param, state in optimizer.state.items() if not state]:
        del optimizer.state[param]


@contextlib.contextmanager
def averaged_weights(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The model holds the averaged weights (x) inside, the training point (y) again after."""
    if not has_modes(optimizer):
        yield
        return
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()
