"""The one place that orders the build steps of a rank, from a frozen spec to the loop's components.

Order matters: weights are created identically on every rank (same seed) before any wrapping;
quantization and adapters change which parameters exist, so they come before the strategy, which
may shard them; the optimizer is built by the strategy over the parameters it finally owns; the
scheduler wraps that optimizer; data comes last and is sharded by rank.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from launcher import device as devices
from launcher.data import BatchStream, PackedSequences, load_corpus
from launcher.distributed import DistContext
from launcher.engine import Components
from launcher.model import build_model, flops_per_token
from launcher.parallel.registry import Setup, build_strategy
from launcher.precision import apply_backend_flags
from launcher.scheduler import build_scheduler
from launcher.spec import RunSpec


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch so that init and data order repeat exactly."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build(spec: RunSpec, dist: DistContext) -> Components:
    """Build model, strategy, optimizer, scheduler and data for this rank."""
    seed_everything(spec.train.seed)
    apply_backend_flags(spec.precision, dist.device.type)
    model = build_model(spec.model)
    strategy = build_strategy(model, Setup(spec=spec, dist=dist))
    scheduler = build_scheduler(strategy.optimizer, spec.scheduler, spec.train.max_steps)
    corpus = load_corpus(spec.data)
    stream = BatchStream(
        PackedSequences(corpus.train, spec.data.seq_len),
        micro_batch_size=spec.train.micro_batch_size,
        seed=spec.train.seed,
        grad_accum_steps=spec.train.grad_accum_steps,
        rank=dist.rank,
        world_size=dist.world_size,
    )
    return Components(
        strategy=strategy,
        scheduler=scheduler,
        stream=stream,
        val=PackedSequences(corpus.val, spec.data.seq_len),
        dist=dist,
        flops_per_token=flops_per_token(spec.model, spec.data.seq_len),
        peak_flops=devices.peak_flops(dist.device.type),
    )
