"""The one place that orders the build steps of a rank, from a frozen spec to the loop's components.

The order, and why:

1. weights, created identically on every rank (same seed) before anything wraps them; a pretrained
   Hugging Face folder under fsdp/tp is built empty instead and read into the shards after the wrap
   (launcher.parallel.pretrained), and the built-in GPT under FSDP2, TP or a pipeline is built on the
   meta device and its initial values regenerated into the shards after the wrap, bitwise those of
   the eager build (launcher.components.model.meta_init): no rank holds the whole model;
2. quantization and adapters, which change which parameters exist, then QAT's fake quantizers
   (launcher.components.qat: nn.Linear -> torchao FakeQuantizedLinear, the same parameters), which must be
   in the module tree before TP splits, compile traces and DDP/FSDP2 wrap it; with
   precision.param_dtype=bf16 the parameters are then stored in bf16 (launcher.components.precision),
   so DDP's buckets, FSDP2's shards and the optimizer's state are created in bf16;
3. the model parts: the whole model, or with parallel.pp_size > 1 this rank's pipeline stages (the
   one stage plan, launcher.parallel.dims);
4. the objective (launcher.components.objectives: cross-entropy, distillation, or a preference loss)
   with the frozen model it declares, a teacher or a reference, placed like the student
   (launcher.rank.objective);
5. launcher.parallel.parallelize on each part, in its fixed order: tensor parallelism ->
   activation checkpointing/offload -> the micro-batch search (memory.auto_micro_batch, a hook that
   measures the part as a step holds it: eager, split by TP, or after the FSDP2 wrap, sharded; refused
   with pipelines) -> compile -> the data-parallel wrap (FSDP2, DDP, none);
6. the strategy over the parts (DeepSpeed wraps its engine here) with the optimizer over the
   parameters it finally owns (under ZeRO-3 the micro-batch search runs here, on the engine's
   partitioned model); the LR schedule wraps that optimizer; the runner the loop calls for a step:
   the whole model, or the pipeline's schedule;
7. data, last, sharded by data-parallel rank with the chosen batch split (tokenized once, cached, and
   loaded once: a precomputed reference reads the same corpus first), as the loop's step-input source
   (launcher.rank.sources.TokenSource); the ranks of a context-parallel group read the same batches
   and each keeps its chunks of them. Online RL (grpo, rloo) reads prompts instead, and its source samples
   each step's batches with the policy (launcher.rank.rollouts).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn

from launcher.components import device as devices
from launcher.components import memory, prune, qat, quantization
from launcher.components.batch_split import BatchSplit
from launcher.components.data.batching import build_stream
from launcher.components.data.interleave import HeldOut
from launcher.components.data.loader import BackgroundBatches, PrefetchedBatches
from launcher.components.data.sequences import PackedSequences, check_held_out
from launcher.components.data.tokens import Corpus, build_cache, load_corpus, uses_cache
from launcher.components.model.build import build_model, flops_per_token
from launcher.components.model.context_parallel import shard_batch
from launcher.components.model.hf_routing import HFRouting, routing
from launcher.components.model.long_context import loss_chunking_bypass
from launcher.components.model.meta_init import build_on_meta
from launcher.components.model.moe_balance import MoEBalance, moe_blocks
from launcher.components.model.on_meta import builds_on_meta
from launcher.components.objectives import Objective
from launcher.components.precision import apply_backend_flags, apply_fp8, cast_parameters, train_dtype
from launcher.components.scheduler import build_scheduler
from launcher.config.moe import is_moe_block
from launcher.config.objective import ONLINE
from launcher.parallel import pretrained
from launcher.parallel.dims import DistContext
from launcher.parallel.parallelize import data_parallel_wrap, parallelize, run_mesh
from launcher.parallel.pipeline_stage import StagePlan, split_model
from launcher.parallel.registry import build_strategy
from launcher.parallel.runner import ModelRunner, Runner
from launcher.parallel.strategy import Setup, Strategy
from launcher.rank.engine import Components
from launcher.rank.micro_batch import fit_micro_batch
from launcher.rank.mixture_data import build_mixture
from launcher.rank.objective import RankObjective, build_objective
from launcher.rank.sources import StepSource, TokenSource
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
            build_cache(spec.data, spec.tokenizer, check_contents=False)  # the launcher checked them
        dist.barrier()
    return load_corpus(spec.data, spec.tokenizer)


def _data(
    spec: RunSpec,
    dist: DistContext,
    batch: BatchSplit,
    corpus: Corpus | None,
    ref_logps: torch.Tensor | None = None,
) -> TokenSource:
    """Step 7: this rank's step-input source, the data group's stream with its held-out sequences (per source
    for a mixture; `corpus`: the one source's, None for a mixture; `ref_logps`: its precomputed reference
    log-probs)."""
    d, device = spec.data, dist.device
    lengths: dict[str, int] = {}
    if corpus is None:  # a mixture: each source's cached corpus, interleaved by weight
        stream, held_out = build_mixture(spec, dist, batch)
        lengths = dict(zip(stream.names, stream.lengths, strict=True))  # its epoch/<name> record keys
    else:
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
            pairs=d.format if d.format in ("preference", "kto") else None,
            ref_logps=ref_logps,
        )
        val = PackedSequences(corpus.val, d.seq_len, document_mask=d.packing and d.document_mask)
        if spec.train.evaluates():  # fail here, not at the first evaluation (the launching process first)
            check_held_out(val, dist.dp_size)
        held_out = (HeldOut(name="", sequences=val, weight=1.0),)
    if d.num_workers > 0:
        stream = PrefetchedBatches(stream, num_workers=d.num_workers, pin_memory=device.type == "cuda")
    elif device.type == "cuda":  # pinned batches built ahead by a thread; on CPU it would compete for cores
        stream = BackgroundBatches(stream, pin_memory=True)
    return TokenSource(stream, held_out=held_out, source_lengths=lengths)


def _runner(strategy: Strategy, setup: Setup, objective: Objective, plan: StagePlan | None) -> Runner:
    """What the loop calls for a step: the pipeline's schedule over the stages, or the whole model."""
    if plan is None:
        return ModelRunner(strategy, objective)
    from launcher.parallel.pipeline import PipelineRunner

    return PipelineRunner(strategy, plan, setup, objective)


def _on_meta(spec: RunSpec, dist: DistContext) -> bool:
    """Whether this rank builds the model on the meta device (launcher.components.model.meta_init): DDP
    and DeepSpeed read the weights as they wrap, so their parts (pipeline stages too) are built eagerly."""
    dims, wrap = dist.dims, data_parallel_wrap(spec, dist.dims)
    return builds_on_meta(
        spec.model,
        splits=(dims.pp > 1 or dims.tp > 1 or wrap == "fsdp") and wrap in ("fsdp", "none"),
        quantization=spec.quantization,
        qat=spec.qat,
        prune=spec.prune,
        precision=spec.precision,
        objective=spec.objective,
        memory=spec.memory,
    )


@dataclass(frozen=True, kw_only=True)
class Trainable:
    """What steps 1-6 give a rank: the strategy over its parts, the runner, the batch split and their hooks."""

    strategy: Strategy
    runner: Runner
    objective: Objective
    rank_objective: RankObjective
    """The objective with the frozen model it declared, as this rank holds it (a precomputed reference until read)."""
    batch: BatchSplit
    dtype: torch.dtype
    """The training dtype, decided once here; every builder and the loop get it from here."""
    pruner: prune.Pruner | None
    qat_switch: Callable[[int], None] | None
    balance: MoEBalance | HFRouting | None = None
    """The MoE blocks' bias update and routing record, or a folder's MoE layers' record (None: no experts)."""


def build_trainable(spec: RunSpec, dist: DistContext, run_dir: Path | None = None) -> Trainable:
    """Steps 1-6 for this rank: model, parts, objective, parallelism, strategy and runner (no data)."""
    seed_everything(spec.train.seed)
    apply_backend_flags(spec.precision, dist.device.type)
    device, dtype = dist.device, train_dtype(spec.precision)  # the training dtype, decided once: passed down
    mesh = run_mesh(spec, dist)
    empty = pretrained.deferred(spec)
    built = build_on_meta(partial(build_model, spec.model)) if _on_meta(spec, dist) else None
    model, init = built or (build_model(spec.model, empty=empty), None)
    if loss_chunking_bypass(spec.parallel, spec.model) is None:  # tp, pp and DeepSpeed keep whole logits
        model.loss_chunks = spec.train.loss_chunks
    model = quantization.apply(
        model, spec.quantization, dtype, device=device, strategy=spec.parallel.data_parallel
    )
    model = qat.prepare(model, spec.qat)
    qat_switch = qat.switch_hook(model, spec.qat)
    model = apply_fp8(model, spec.precision)  # float8 linears before TP, compile and FSDP see them
    pruner = prune.apply(model, spec.prune)  # mask buffers before any wrap: every checkpoint holds them
    model = cast_parameters(model, spec.precision)  # pure bf16: stored bf16 before DDP/FSDP2 see the weights
    # the whole model, or this rank's pipeline stages (the stage plan, asked once)
    plan = dist.dims.stage_plan(spec.parallel, spec.model, spec.data.seq_len, dist.rank)
    parts = [model] if plan is None else split_model(model, plan)
    # the objective, with a teacher or a reference placed like the student
    rank_objective = build_objective(spec, dist, mesh, model, dtype)
    objective = rank_objective.objective
    batch = BatchSplit(
        micro_batch_size=spec.train.micro_batch_size, grad_accum_steps=spec.train.grad_accum_steps
    )

    def measure(part: nn.Module) -> None:  # the objective's state (a teacher) counts in every try
        nonlocal batch
        batch = fit_micro_batch(
            part, spec, device, dtype, run_dir=run_dir, is_main=dist.is_main, objective=objective
        )

    on_engine = spec.parallel.engine_partitions_parameters
    search = measure if spec.memory.auto_micro_batch and not on_engine else None
    stages = parts  # unwrapped: their MoE blocks are the ones the wrapped parts run
    parts = [
        parallelize(part, spec=spec, dist=dist, mesh=mesh, empty=empty, init=init, measure=search)
        for part in parts
    ]
    setup = Setup(spec=spec, dist=dist, batch=batch, dtype=dtype, mesh=mesh)
    strategy = build_strategy(parts, setup)
    if spec.memory.auto_micro_batch and on_engine:  # ZeRO-3 partitions the model in its engine: search there
        batch = fit_micro_batch(
            strategy.model, spec, device, dtype, run_dir=run_dir, is_main=dist.is_main, objective=objective,
            backward=strategy.backward,
        )  # fmt: skip
        strategy.use_batch(batch)
        setup = Setup(spec=spec, dist=dist, batch=batch, dtype=dtype, mesh=mesh)
    rank_objective.bind(strategy.model)  # a LoRA run's reference: the policy with adapters off
    runner = _runner(strategy, setup, objective, plan)
    return Trainable(
        strategy=strategy,
        runner=runner,
        objective=objective,
        rank_objective=rank_objective,
        batch=batch,
        dtype=dtype,
        pruner=pruner,
        qat_switch=qat_switch,
        balance=_balance(model if plan is None else stages, spec, dist),
    )


def _balance(
    model: nn.Module | list[nn.Module], spec: RunSpec, dist: DistContext
) -> MoEBalance | HFRouting | None:
    """The loss-free balancing and routing record of the model's MoE blocks (None without any).

    A Hugging Face folder's MoE layers get their routing record (launcher.components.model.hf_routing)
    when the model is whole on the rank's stage (not pipelined).

    `model` is the whole model, or this rank's pipeline stages: then every stage's data-parallel ranks
    count their own blocks' tokens (each block is on one stage), so the record sums over every stage.
    """
    if isinstance(model, nn.Module):
        blocks = moe_blocks(model)
        if not blocks:
            return routing(model, dist.data_sum)  # a folder's MoE layers, or None
        rate = spec.model.moe.bias_update_rate
        return MoEBalance(blocks, rate=rate, world_size=dist.world_size, data_sum=dist.data_sum)
    moe = spec.model.moe
    if moe.num_experts <= 0:
        return None
    layout = {i: moe.num_experts for i in range(spec.model.n_layer) if is_moe_block(moe, i)}
    blocks = {i: block for part in model for i, block in moe_blocks(part).items()}
    tp_rank = dist.dims.tp_rank(dist.rank)

    def stages_sum(values: list[float]) -> list[float]:  # tensor-parallel peers hold the same tokens
        return dist.sum([v if tp_rank == 0 else 0.0 for v in values])

    return MoEBalance(
        blocks, rate=moe.bias_update_rate, world_size=dist.world_size, data_sum=stages_sum, layout=layout
    )


def build(spec: RunSpec, dist: DistContext, run_dir: Path | None = None) -> Components:
    """Build model, strategy, optimizer, scheduler and data for this rank."""
    trainable = build_trainable(spec, dist, run_dir)
    strategy, runner, objective, batch = (
        trainable.strategy,
        trainable.runner,
        trainable.objective,
        trainable.batch,
    )
    pruner, qat_switch, device = trainable.pruner, trainable.qat_switch, dist.device
    balance = trainable.balance
    scheduler = build_scheduler(strategy.optimizer, spec.scheduler, spec.train.max_steps)
    source: StepSource
    if spec.objective.name in ONLINE:  # grpo, rloo: the policy samples each step's batches
        from launcher.rank.rollout_build import build_rollouts

        source = build_rollouts(spec, trainable.dtype, run_dir)
    elif spec.distill.on_policy:  # the student samples each step's batches, the teacher scores them
        from launcher.rank.on_policy_source import build_source

        corpus = None if spec.data.format == "prompt" else _corpus(spec, dist)  # prompt records: read whole
        source = build_source(spec, corpus, dist, trainable.dtype, run_dir)
    else:
        # loaded once: a precomputed reference reads it first
        corpus = None if spec.data.sources else _corpus(spec, dist)
        ref_logps = trainable.rank_objective.precompute(spec, dist, corpus)  # objective.reference=precompute
        source = _data(spec, dist, batch, corpus, ref_logps)
    return Components(
        spec=spec,
        batch=batch,
        dtype=trainable.dtype,
        strategy=strategy,
        runner=runner,
        objective=objective,
        scheduler=scheduler,
        source=source,
        dist=dist,
        flops_per_token=flops_per_token(spec.model, spec.data.seq_len),
        peak_flops=devices.peak_flops(device.type),
        after_step=[
            hook
            for hook in [
                pruner and pruner.after_step,
                balance and balance.after_step,
                memory.empty_cache_hook(spec.memory, device.type),
            ]
            if hook
        ],
        record_extras=[
            extra
            for extra in [
                pruner and pruner.record,
                balance and balance.record,
                partial(objective.metrics, dist.data_sum),
            ]
            if extra
        ],
        before_step=[hook for hook in [qat_switch, balance and balance.before_step] if hook],
        local_batch=(
            partial(shard_batch, rank=dist.dims.cp_rank(dist.rank), size=dist.dims.cp)
            if dist.dims.cp > 1
            else None
        ),
    )
