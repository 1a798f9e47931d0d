"""A step's micro batches and counts, and the one collective that agrees on them and on a stop signal.

Every optimizer step divides each rank's summed loss by the mean of the step's trained terms over the
data-parallel ranks (launcher.parallel.dims.DistContext.data_mean), and, where signal handlers are
installed, every rank agrees after the step whether any of them received a stop signal
(launcher.rank.preemption). Both are tiny all-reduces, and on a busy machine each collective is a
point where a rank waits for a descheduled peer, which a plain DDP script (one gradient all-reduce
per step) does not have. So after a step the loop draws the next step's micro batches, counts them,
and agrees on their terms and the stop flag in one all-reduce where both travel on the same CPU
group (gloo, every CPU run). The batches come from the run's step-input source (launcher.rank.sources);
the step's checkpoint keeps the source's position from before that draw, so a resume draws the same
batches again; drawing uses the source's own seeded state, never the global RNG the checkpoint keeps. On CUDA the terms stay on the device (NCCL) and the flag on its CPU
group, as before: two collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from launcher.components.objectives import trained_tokens
from launcher.rank.sources import Batch, SourceContext, StepSource

if TYPE_CHECKING:
    from launcher.components.metrics import PhaseTimer
    from launcher.parallel.dims import DistContext
    from launcher.rank.preemption import StopSignal


@dataclass(frozen=True, kw_only=True)
class StepInputs:
    """One optimizer step's micro batches on the device and what the loop counts of them."""

    batches: list[Batch]
    """grad_accum_steps micro batches, moved to the device."""
    samples: int
    """Sequences this rank counts (0 where a context-parallel peer counts them)."""
    num_tokens: int
    """Trained tokens (labels != -100) of this rank's batches."""
    num_processed: int
    """Tokens of this rank's batches that go through the model: every row's positions (padding included)."""
    num_terms: int
    """The objective's count of this rank's batches: the step's loss is their mean over ranks."""
    terms_per_rank: int | torch.Tensor
    """The mean of num_terms over the data-parallel ranks (a float32 tensor where there are several)."""
    data_state: dict[str, Any]
    """The source's position before these batches were drawn: what a checkpoint of the previous step keeps."""


def draw(
    source: StepSource,
    step: int,
    ctx: SourceContext,
    *,
    stop: StopSignal | None,
    timer: PhaseTimer,
    counts_samples: bool,
    local_batch: Callable[[Batch], Batch] | None,
) -> tuple[StepInputs, int | None]:
    """Step `step`'s inputs (0-based) from `source` and, with `stop`, the signal every rank stops on (see `agree`)."""
    timer.start("data")
    data_state = source.state_dict()
    batches = source.micro_batches(step, ctx)
    # ranks that drew different counts would wait on each other in a collective: stop here instead
    if len(batches) != ctx.batch.grad_accum_steps:
        raise RuntimeError(
            f"{type(source).__name__} gave {len(batches)} micro batches for step {step}; a step takes "
            f"train.grad_accum_steps={ctx.batch.grad_accum_steps} on every rank"
        )
    objective, dist = ctx.objective, ctx.dist
    samples = sum(len(b["input_ids"]) for b in batches) if counts_samples else 0
    if local_batch is not None:
        batches = [local_batch(b) for b in batches]
    num_tokens = sum(trained_tokens(b) for b in batches)  # CPU tensors: no device sync
    num_processed = sum(b["input_ids"].numel() for b in batches)
    num_terms = sum(objective.count(b) for b in batches)  # tokens, or a preference's pairs
    batches = [{k: v.to(dist.device, non_blocking=True) for k, v in b.items()} for b in batches]
    # The data phase is making batches only: the collective below waits for the slowest rank (on
    # gloo it blocks), which is compute skew, not input, so it counts with the forward phase.
    timer.start("forward")
    terms_per_rank, signum = agree(dist, num_terms, stop)
    inputs = StepInputs(batches=batches, samples=samples, num_tokens=num_tokens, num_processed=num_processed,
                        num_terms=num_terms, terms_per_rank=terms_per_rank, data_state=data_state)  # fmt: skip
    return inputs, signum


def agree(
    dist: DistContext, num_terms: int, stop: StopSignal | None
) -> tuple[int | torch.Tensor, int | None]:
    """(the mean of `num_terms` over data-parallel ranks, the signal every rank stops on or None): `stop`
    None asks for the terms alone. One CPU all-reduce where the job's backend is gloo; on others the
    terms' on the device and the flag's on the CPU group."""
    import torch.distributed as tdist

    asks_stop = stop is not None and stop.installed
    if dist.world_size == 1 or not asks_stop or tdist.get_backend() != "gloo":
        return dist.data_mean(num_terms), stop.agreed(dist) if stop is not None else None
    numbers = stop.numbers
    counted = num_terms if dist.dims.counts_data(dist.rank) else 0
    own = int(stop.received or 0)
    # terms, then one slot per signal: summed, a slot above 0 means some rank received that signal
    values = torch.tensor([float(counted), *(float(own == n) for n in numbers)], dtype=torch.float64)
    tdist.all_reduce(values)
    total, *slots = values.tolist()
    received = [n for n, count in zip(numbers, slots, strict=True) if count > 0]
    # as data_mean: the float32 sum of whole counts (exact below 2**24), divided on the tensor
    terms = torch.tensor(total, dtype=torch.float32, device=dist.device) / dist.dims.batch_ranks
    return terms, max(received) if received else None
