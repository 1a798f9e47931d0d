"""The one place that orders the build steps of a rank, from a frozen spec to the loop's components.

Order matters: weights are created identically on every rank (same seed) before any wrapping;
quantization and adapters change which parameters exist, so they come before the strategy, which
may shard them; activation checkpointing and offload wrap the blocks next; the micro-batch search
(memory.auto_micro_batch) measures that eager model and returns a new spec with the micro batch it
chose (everything after, data included, uses it); compile traces the checkpointed blocks before the
strategy wraps them; the strategy builds the optimizer over the parameters it finally owns; the
scheduler wraps that optimizer; data comes last and is sharded by data-parallel rank.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import torch

from launcher.groups import device as devices
from launcher.groups import memory, quantization
from launcher.groups.batching import build_stream
from launcher.groups.compile import apply as compile_model
from launcher.groups.data import PackedSequences, load_corpus
from launcher.groups.model.gpt import build_model, flops_per_token
from launcher.groups.precision import apply_backend_flags
from launcher.groups.scheduler import build_scheduler
from launcher.parallel.dims import DistContext
from launcher.parallel.registry import Setup, build_strategy
from launcher.rank.engine import Components
from launcher.rank.micro_batch import fit_micro_batch
from launcher.spec import RunSpec


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch so that init and data order repeat exactly."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build(spec: RunSpec, dist: DistContext, run_dir: Path | None = None) -> Components:
    """Build model, strategy, optimizer, scheduler and data for this rank."""
    seed_everything(spec.train.seed)
    apply_backend_flags(spec.precision, dist.device.type)
    model = build_model(spec.model)
    model = quantization.apply(model, spec.quantization, spec.precision, device=dist.device)
    # Memory techniques wrap the blocks that exist after quantization and adapters, and before
    # compile traces them and the strategy shards them.
    model = memory.apply(model, spec.memory)
    if spec.memory.auto_micro_batch:  # measured on the eager model; a new spec, recorded in run_dir
        spec = fit_micro_batch(model, spec, dist.device, run_dir=run_dir, is_main=dist.is_main)
    model = compile_model(model, spec.compile)
    # Ranks of one tensor-parallel group compute on the same batch: data is split by dp rank.
    dist = dataclasses.replace(dist, tp_size=spec.parallel.tp_size)
    strategy = build_strategy(model, Setup(spec=spec, dist=dist))
    scheduler = build_scheduler(strategy.optimizer, spec.scheduler, spec.train.max_steps)
    corpus = load_corpus(spec.data)
    d = spec.data
    stream = build_stream(
        corpus,
        seq_len=d.seq_len,
        packing=d.packing,
        batching=d.batching,
        max_tokens_per_batch=d.max_tokens_per_batch,
        micro_batch_size=spec.train.micro_batch_size,
        seed=spec.train.seed,
        grad_accum_steps=spec.train.grad_accum_steps,
        rank=dist.dp_rank,
        world_size=dist.dp_size,
    )
    return Components(
        strategy=strategy,
        scheduler=scheduler,
        stream=stream,
        val=PackedSequences(corpus.val, spec.data.seq_len),
        dist=dist,
        flops_per_token=flops_per_token(spec.model, spec.data.seq_len),
        peak_flops=devices.peak_flops(dist.device.type),
        spec=spec,
        after_step=[hook for hook in [memory.empty_cache_hook(spec.memory, dist.device.type)] if hook],
    )
