"""The cut of one rank's share of an optimizer step into micro batches: what the build hands on.

Kept apart from launcher.components.data.batching (the data streams, which need torch) so that the launching
process can derive a DeepSpeed config from it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class BatchSplit:
    """How one rank's share of an optimizer step is cut: micro batches of this size, this many of them.

    The spec asks for one (train.micro_batch_size x train.grad_accum_steps); with
    memory.auto_micro_batch the search chooses another split of the same per-rank batch, and the
    build passes that choice on (to the data, the loop and DeepSpeed's config) as this value.
    """

    micro_batch_size: int
    """Sequences per forward/backward pass on one rank."""
    grad_accum_steps: int
    """Micro batches accumulated per optimizer step."""
