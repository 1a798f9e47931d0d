"""The one place that orders the build steps of a rank, from a frozen spec to the loop's components.

The order, and why (it follows torchtitan's parallelize: TP, then checkpointing, then compile, then
the data-parallel wrap):

1. weights, created identically on every rank (same seed) before anything wraps them; a pretrained
   Hugging Face folder under fsdp/tp is built empty instead and read into the shards after step 7
   (launcher.parallel.pretrained);
2. quantization and adapters, which change which parameters exist, then QAT's fake quantizers
   (launcher.groups.qat: nn.Linear -> torchao FakeQuantizedLinear, the same parameters), which must be
   in the module tree before TP splits, compile traces and DDP/FSDP2 wrap it; under strategy pp the
   model is then cut into this rank's pipeline stages, and steps 3, 4 and 6 apply to each stage;
3. tensor parallelism, which splits the blocks' projections into DTensors (and needs them on the device);
4. activation checkpointing and offload, which wrap the (split) blocks' forward;
5. the micro-batch search (memory.auto_micro_batch), which measures that eager model and chooses a
   batch split (refused with TP, FSDP and ZeRO-3, whose sharding it cannot see);
6. compile, which traces each block with its checkpointing and tensor-parallel hooks inside;
7. the data-parallel wrap (DDP, FSDP2, DeepSpeed), which shards or replicates what it is given and
   builds the optimizer over the parameters it finally owns; the LR schedule wraps that optimizer;
8. data, last, sharded by data-parallel rank with the chosen batch split (tokenized once, cached).
"""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from launcher.groups import device as devices
from launcher.groups import memory, prune, qat, quantization
from launcher.groups.batch_split import BatchSplit
from launcher.groups.batching import build_stream
from launcher.groups.compile import apply as compile_model
from launcher.groups.data.loader import BackgroundBatches, PrefetchedBatches
from launcher.groups.data.sequences import PackedSequences, check_held_out
from launcher.groups.data.tokens import Corpus, build_cache, load_corpus, uses_cache
from launcher.groups.model.build import build_model, flops_per_token
from launcher.groups.precision import apply_backend_flags, apply_fp8
from launcher.groups.scheduler import build_scheduler
from launcher.parallel import pretrained
from launcher.parallel.dims import DistContext
from launcher.parallel.pipeline_stage import plan_stages, split_model
from launcher.parallel.registry import STRATEGIES, build_strategy
from launcher.parallel.strategy import Setup
from launcher.rank.engine import Components
from launcher.rank.micro_batch import fit_micro_batch
from launcher.rank.mixture_data import build_mixture, epochs_extra
from launcher.rank.teacher import build_distiller
from launcher.spec import RunSpec


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch so that init and data order repeat exactly."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _corpus(spec: RunSpec, dist: DistContext) -> Corpus:
    """The tokenized corpus; a cached one is made by rank 0 while the others wait (the launcher usually has)."""
    if uses_cache(spec.data, spec.tokenizer):
        if dist.is_main:
            build_cache(spec.data, spec.tokenizer)
        dist.barrier()
    return load_corpus(spec.data, spec.tokenizer)


def _prepare(
    model: nn.Module, spec: RunSpec, dist: DistContext, mesh: DeviceMesh | None, empty: bool
) -> nn.Module:
    """Steps 3 and 4 on a whole model or one pipeline stage: tensor parallelism, then checkpointing and offload."""
    if dist.dims.tp > 1:
        # DTensor and DCP take about a second to import: only a tensor-parallel run pays for them
        from launcher.parallel.tensor_parallel import apply_tensor_parallel

        model = apply_tensor_parallel(
            model if empty else model.to(dist.device),
            mesh["tp"],
            sequence_parallel=spec.parallel.sequence_parallel,
        )
    return memory.apply(model, spec.memory)


def build(spec: RunSpec, dist: DistContext, run_dir: Path | None = None) -> Components:
    """Build model, strategy, optimizer, scheduler and data for this rank."""
    seed_everything(spec.train.seed)
    apply_backend_flags(spec.precision, dist.device.type)
    device = dist.device
    mesh = dist.dims.build_mesh(device.type) if STRATEGIES[spec.parallel.strategy].device_mesh else None
    empty = pretrained.deferred(spec)
    model = build_model(spec.model, empty=empty)
    model = quantization.apply(
        model, spec.quantization, spec.precision, device=device, strategy=spec.parallel.strategy
    )
    model = qat.prepare(model, spec.qat)
    qat_switch = qat.switch_hook(model, spec.qat)
    model = apply_fp8(model, spec.precision)  # float8 linears before TP, compile and FSDP see them
    pruner = prune.apply(model, spec.prune)  # mask buffers before any wrap: every checkpoint holds them
    if spec.parallel.strategy == "pp":  # this rank's stages, each prepared below as a whole model would be
        plan = plan_stages(spec.model, spec.parallel, spec.data.seq_len, dist.dims.pp_rank(dist.rank))
        model = nn.ModuleList(
            [_prepare(stage, spec, dist, mesh, empty) for stage in split_model(model, plan)]
        )
    else:
        model = _prepare(model, spec, dist, mesh, empty)
    batch = BatchSplit(
        micro_batch_size=spec.train.micro_batch_size, grad_accum_steps=spec.train.grad_accum_steps
    )
    distiller = build_distiller(spec, dist, mesh)  # frozen teacher, placed like the student
    if spec.memory.auto_micro_batch:  # the teacher's weights, logits and KL chunks count in every try
        batch = fit_micro_batch(
            model, spec, device, run_dir=run_dir, is_main=dist.is_main, distiller=distiller
        )
    for module in model if spec.parallel.strategy == "pp" else [model]:
        compile_model(module, spec.compile)
    load_weights = (lambda wrapped: pretrained.load_into_shards(wrapped, spec.model, dist)) if empty else None
    setup = Setup(spec=spec, dist=dist, batch=batch, mesh=mesh, load_weights=load_weights)
    strategy = build_strategy(model, setup)
    strategy.distiller = distiller
    scheduler = build_scheduler(strategy.optimizer, spec.scheduler, spec.train.max_steps)
    d = spec.data
    if d.sources:  # a mixture: each source's cached corpus, interleaved by weight
        mixed, held_out = build_mixture(spec, dist, batch)
        stream, val = mixed, held_out[0].sequences
    else:
        corpus = _corpus(spec, dist)
        stream = build_stream(
            corpus,
            seq_len=d.seq_len,
            packing=d.packing,
            document_mask=d.document_mask,
            batching=d.batching,
            max_tokens_per_batch=d.max_tokens_per_batch,
            micro_batch_size=batch.micro_batch_size,
            seed=spec.train.seed,
            grad_accum_steps=batch.grad_accum_steps,
            rank=dist.dp_rank,
            world_size=dist.dp_size,
        )
        mixed, held_out = None, ()
        val = PackedSequences(corpus.val, d.seq_len, document_mask=d.packing and d.document_mask)
        if (
            spec.train.eval_every
        ):  # fail here, not at the first evaluation (the launching process refuses it first)
            check_held_out(val, dist.dp_size)
    if d.num_workers > 0:
        stream = PrefetchedBatches(stream, num_workers=d.num_workers, pin_memory=device.type == "cuda")
    elif device.type == "cuda":  # pinned batches built ahead by a thread; on CPU it would compete for cores
        stream = BackgroundBatches(stream, pin_memory=True)
    return Components(
        spec=spec,
        batch=batch,
        strategy=strategy,
        scheduler=scheduler,
        stream=stream,
        val=val,
        held_out=held_out,
        dist=dist,
        flops_per_token=flops_per_token(spec.model, spec.data.seq_len),
        peak_flops=devices.peak_flops(device.type),
        after_step=[
            hook
            for hook in [pruner and pruner.after_step, memory.empty_cache_hook(spec.memory, device.type)]
            if hook
        ],
        record_extras=[
            extra
            for extra in [
                pruner and pruner.record,
                distiller and partial(distiller.metrics, dist.data_sum),
                mixed and epochs_extra(stream, mixed),
            ]
            if extra
        ],
        before_step=[qat_switch] if qat_switch else [],
    )
