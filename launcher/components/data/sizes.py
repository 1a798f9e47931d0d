"""How many training sequences a tokenized side makes, counted the way the ranks will cut it (numpy only).

The launching process counts before any rank starts, so a corpus that cannot fill one optimizer
step, or give every rank a held-out batch, is refused with the numbers instead of failing inside a
rank. The counts equal `len()` of the datasets the ranks build: `PackedSequences` (the stream cut into
rows of seq_len inputs + 1 label token) and `Documents` (one document per row, a longer one cut into
pieces of at most seq_len inputs); tests/unit/test_data_sizes.py holds them equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from launcher.components.data.tokens import START


def packed_sequences(num_tokens: int, seq_len: int) -> int:
    """Rows of seq_len inputs (and one more token for the last label) a token stream holds back to back."""
    return max((num_tokens - 1) // seq_len, 0)


def document_sequences(flags: np.ndarray, seq_len: int) -> int:
    """Rows of one document each (a document of n tokens makes ceil((n - 1) / seq_len)), from the START flags."""
    starts = np.flatnonzero(flags & START)
    bounds = np.unique(np.concatenate([[0], starts, [len(flags)]]))
    inputs = np.maximum(np.diff(bounds) - 1, 0)
    return int(np.sum((inputs + seq_len - 1) // seq_len))


@dataclass(frozen=True, kw_only=True)
class StepNeeds:
    """What one optimizer step and one evaluation take from the data, per the batch settings."""

    micro_batch_size: int
    """Sequences per rank per micro batch."""
    grad_accum_steps: int
    """Micro batches per optimizer step."""
    dp_size: int
    """Data-parallel ranks: each reads different sequences."""

    @property
    def train_sequences(self) -> int:
        """Sequences of one optimizer step: micro_batch_size x grad_accum_steps x dp_size."""
        return self.micro_batch_size * self.grad_accum_steps * self.dp_size

    @property
    def val_sequences(self) -> int:
        """Held-out sequences an evaluation needs: one per data-parallel rank (batches shrink to fit)."""
        return self.dp_size
