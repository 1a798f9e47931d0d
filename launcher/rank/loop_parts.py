"""What the training loop drives: the components `launcher.rank.build` makes once per rank."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from launcher.components.batch_split import BatchSplit
from launcher.components.objectives import Objective
from launcher.components.objectives.cross_entropy import CrossEntropy
from launcher.parallel.dims import DistContext
from launcher.parallel.runner import Runner
from launcher.parallel.strategy import Strategy
from launcher.rank.sources import StepSource
from launcher.spec import RunSpec

__all__ = ["Components"]


@dataclass(kw_only=True)
class Components:
    """Everything the loop drives, built once per rank by `launcher.rank.build`."""

    spec: RunSpec
    """The spec the components were built for: the only spec the engine reads."""
    batch: BatchSplit
    """Micro batch and accumulation steps (the spec's, or the micro-batch search's choice)."""
    dtype: torch.dtype
    """The training steps' autocast dtype, decided once by `launcher.rank.build` (float32: no autocast)."""
    strategy: Strategy
    """The parallel strategy: wrapped model parts, optimizer and the loop's verbs."""
    runner: Runner
    """Forward and backward of a micro batch (the whole model, or the pipeline's schedule) with the objective's loss."""
    scheduler: torch.optim.lr_scheduler.LRScheduler
    """The learning-rate schedule over the strategy's optimizer."""
    source: StepSource
    """Each step's micro batches for this rank and the held-out sequences (launcher.rank.sources)."""
    dist: DistContext
    """This rank's place in the job."""
    flops_per_token: float
    """Training FLOPs per token of the model (for MFU)."""
    peak_flops: float | None
    """The device's dense peak FLOP/s, None where unknown (every CPU)."""
    objective: Objective = field(default_factory=CrossEntropy)
    """The loss the runner asks for; its `count` of a batch's terms (tokens, pairs) normalizes each step."""
    record_extras: list[Callable[[], dict[str, float]]] = field(default_factory=list)
    """Called at each log step; their keys join the metrics record (e.g. the pruned layers' sparsity)."""
    after_step: list[Callable[[int], None]] = field(default_factory=list)
    """Called with the step number after every optimizer step (e.g. memory.empty_cache_steps)."""
    before_step: list[Callable[[int], None]] = field(default_factory=list)
    """Called with the 0-based index of the step about to run, before its first forward (e.g. the QAT switch)."""
    local_batch: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    """This rank's part of a batch its group reads whole (context parallel: its chunks of every sequence)."""
