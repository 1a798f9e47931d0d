"""The plan of a pipeline-parallel run (parallel.pp_size > 1): what each pipeline rank holds and needs, and the bubble.

A run has pp_size x pp_stages_per_rank stages of consecutive decoder layers; stage 0 also holds
the embeddings, the last stage the final norm and LM head (a tied head as a second copy, even on
the rank that holds stage 0 too, as launcher.parallel.pipeline_stage builds it). Where the stages
sit comes in a `PipelineLayout`: launcher.parallel.pipeline_split places them as the ranks do,
and the planner may import only spec and groups, so the caller (the dry run) builds the layout.

Per pipeline rank: its stages' weights, gradients and optimizer state (MODEL_STATES["pp"]: FSDP2
over the world / (pp x tp) data-parallel ranks when there are several), and the activations its
schedule keeps in flight, each pipeline micro batch being train.micro_batch_size / pp_microbatches
sequences through the stage's layers. In flight when the rank's first backward starts (the steady
state keeps that count), from torch.distributed.pipelining's schedules:

- gpipe: all pp_microbatches (m) on every stage, since every forward runs before any backward;
- 1f1b: stage s holds min(m, pp_size - s), so the first stage holds the most (pp_size);
- interleaved_1f1b: torch's (v - 1) x round + 2 (p - 1 - rank) warmup forwards plus one, at most
  m x v, each counted on the stage it runs (round: micro batches per round, p when p divides m);
- zero_bubble (ZB-V): 2p - rank - 1 forwards of the rank's first stage and rank + 1 of its second,
  2p stage micro batches on every rank (1F1B's peak in half-size stages); weight gradients deferred
  to fill the bubble keep some layer inputs a little longer, which is not counted.

A stage's held micro batch keeps its layers' saved tensors (checkpointing as in
launcher.plan.activations), the stage output it backpropagates through (not on the last stage) and
on the last stage the logits' log-probabilities; the loss gradients and one checkpointed layer's
recomputation come once on top. The plan's figure is the largest rank's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from launcher.components.model.shape import model_shape
from launcher.config.model import vocab_size
from launcher.plan import activations as acts
from launcher.plan.planner import MemoryPlan, activation_shape, device_plan
from launcher.plan.states import ParamCounts, count_params, gpt_view, model_states
from launcher.spec import RunSpec

FP32 = 4


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """Where a pipeline's stages sit, as launcher.parallel.pipeline_split places them."""

    stage_layers: tuple[range, ...]
    """Decoder layers of every stage, stage 0 first."""
    rank_stages: tuple[tuple[int, ...], ...]
    """Stage indices each pipeline rank holds (pipeline rank 0 first), in its schedule's order."""
    bubble: float
    """The schedule's theoretical idle share of a pipeline step."""


@dataclass(frozen=True, kw_only=True)
class ModelParts:
    """The model's parameters by where a pipeline puts them."""

    embedding: int
    """Token (and position) embeddings: on stage 0."""
    layer: int
    """One decoder layer."""
    final: int
    """Final norm and an untied LM head: on the last stage."""
    tied_head: int
    """The tied embedding matrix the last stage holds a copy of (0 when the head is untied)."""


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """One pipeline rank: its stages, their layers and parameters, and its memory."""

    pp_rank: int
    """Position along the pipeline dimension."""
    stages: tuple[int, ...]
    """Stage indices it holds, in schedule order."""
    layers: tuple[range, ...]
    """Decoder layers of each of its stages."""
    embedding: bool
    """Whether it holds stage 0 (the embeddings)."""
    head: bool
    """Whether it holds the last stage (final norm and LM head)."""
    num_params: int
    """Parameters of its stages (before any data-parallel sharding or tensor-parallel split)."""
    in_flight: tuple[int, ...]
    """Pipeline micro batches each of its stages keeps for backward at the peak."""
    memory: MemoryPlan
    """Per-device bytes of each of its ranks."""


@dataclass(frozen=True, kw_only=True)
class PipelinePlan:
    """Every pipeline rank's plan, the schedule and its bubble; `memory` is the largest rank's."""

    schedule: str
    """parallel.pp_schedule."""
    microbatches: int
    """Pipeline micro batches per pipeline step (parallel.pp_microbatches)."""
    stages_per_rank: int
    """Stages each pipeline rank holds."""
    bubble: float
    """The schedule's theoretical idle share of a pipeline step."""
    ranks: tuple[RankPlan, ...]
    """One plan per pipeline rank, rank 0 first."""

    @property
    def worst(self) -> RankPlan:
        """The pipeline rank needing the most device memory."""
        return max(self.ranks, key=lambda r: r.memory.total)

    @property
    def memory(self) -> MemoryPlan:
        """The per-device plan of the largest rank: what every device must fit."""
        return self.worst.memory


def model_parts(spec: RunSpec) -> ModelParts:
    """Embeddings, one layer and the head's parameters (a Hugging Face model: its linears and two norms per layer)."""
    cfg, counts = model_shape(spec.model).equivalent, count_params(spec)
    d, vocab, n = cfg.d_model, vocab_size(cfg), max(cfg.n_layer, 1)
    head = 0 if cfg.tie_embeddings else vocab * d
    if spec.model.kind == "gpt":  # exact, as config_num_params counts it
        norm, embedding = d * (1 + int(cfg.bias)), vocab * d + cfg.max_seq_len * d
        layer = (counts.total - embedding - norm - head) // n
    else:  # the layers' linears and norms; the embeddings are the rest
        norm, layer = d, counts.block_linear // n + 2 * d
        embedding = counts.total - n * layer - norm - head
    return ModelParts(embedding=embedding, layer=layer, final=norm + head, tied_head=vocab * d - head)


def rank_counts(spec: RunSpec, layers: int, *, embedding: bool, head: bool) -> ParamCounts:
    """The parameters by role of a pipeline rank holding `layers` decoder layers (and the embeddings/head)."""
    parts, whole = model_parts(spec), count_params(spec)
    n = max(model_shape(spec.model).equivalent.n_layer, 1)
    total = layers * parts.layer + (parts.embedding if embedding else 0)
    total += parts.final + parts.tied_head if head else 0
    block_linear, adapters = whole.block_linear // n * layers, whole.adapters // n * layers
    trainable = adapters or (total - block_linear if spec.quantization.method != "none" else total)
    return ParamCounts(
        total=total,
        block_linear=block_linear,
        adapters=adapters,
        trainable=trainable,
        head=whole.head if head else 0,
    )


def in_flight(spec: RunSpec, pp_rank: int, stages: tuple[int, ...]) -> tuple[int, ...]:
    """Pipeline micro batches each of the rank's `stages` keeps for backward at its peak (see the module)."""
    p, m, schedule = spec.parallel.pp_size, spec.parallel.pp_microbatches, spec.parallel.pp_schedule
    v = len(stages)
    if schedule == "gpipe":
        return (m,) * v
    if schedule == "zero_bubble":
        return (min(m, 2 * p - pp_rank - 1), min(m, pp_rank + 1))
    if schedule == "interleaved_1f1b":
        per_round = m // max(1, m // p)
        forwards = min((v - 1) * per_round + 2 * (p - 1 - pp_rank) + 1, m * v)
        return tuple(sum(1 for k in range(forwards) if (k // per_round) % v == i) for i in range(v))
    num_stages = p * v
    return tuple(min(m, num_stages - s) for s in stages)


def pipeline_micro_batch(spec: RunSpec) -> int:
    """Sequences in one pipeline micro batch: train.micro_batch_size cut into pp_microbatches (rounded up)."""
    return math.ceil(spec.train.micro_batch_size / max(spec.parallel.pp_microbatches, 1))


def _activations(
    spec: RunSpec, layout: PipelineLayout, stages: tuple[int, ...], held: tuple[int, ...]
) -> tuple[float, float]:
    """(peak activation bytes of the rank's stages, what offloading keeps on the device)."""
    cfg, mem = gpt_view(spec).model, spec.memory
    shape = activation_shape(spec, pipeline_micro_batch(spec))
    last = len(layout.stage_layers) - 1
    boundary = shape.micro_batch * shape.seq_len * cfg.d_model * FP32  # a stage's float32 output
    total, once, kept = 0.0, 0.0, float(acts.layer_bytes(cfg, shape))
    for stage, count in zip(stages, held, strict=True):
        saved, recompute = acts.layers_bytes(
            cfg,
            shape,
            layout.stage_layers[stage],
            mode=mem.activation_checkpointing,
            checkpoint_every=mem.checkpoint_every,
        )
        if stage == last:
            grads = acts.loss_grad_bytes(cfg, shape)
            saved += acts.head_bytes(cfg, shape) - grads
            once, kept = max(once, recompute + grads), kept + acts.head_bytes(cfg, shape)
        else:
            saved += boundary
            once = max(once, recompute)
        # each stage builds the batch's dense document mask (sdpa) and rotary tables itself
        saved += acts.mask_bytes(shape) + acts.rotary_bytes(shape)
        total += count * saved
    return total + once, kept


def rank_plan(spec: RunSpec, layout: PipelineLayout, pp_rank: int, world: int, kind: str) -> RankPlan:
    """The stages, parameters and per-device memory of pipeline rank `pp_rank`."""
    stages = layout.rank_stages[pp_rank]
    last = len(layout.stage_layers) - 1
    layers = tuple(layout.stage_layers[s] for s in stages)
    embedding, head = 0 in stages, last in stages
    gpt = gpt_view(spec)
    num_layers = sum(len(r) for r in layers)
    # n_layer: FSDP2 gathers one of this rank's layers at a time
    local = dataclasses.replace(gpt, model=dataclasses.replace(gpt.model, n_layer=max(num_layers, 1)))
    counts = rank_counts(spec, num_layers, embedding=embedding, head=head)
    states = model_states(local, world, counts)
    micro = pipeline_micro_batch(spec)
    boundary = micro * spec.data.seq_len * gpt.model.d_model * FP32
    states = dataclasses.replace(states, buffers=states.buffers + 2 * len(stages) * boundary)  # p2p recv
    held = in_flight(spec, pp_rank, stages)
    activations, kept = _activations(spec, layout, stages, held)
    notes = [
        states.note,
        f"pipeline micro batch {micro} x {spec.data.seq_len} tokens, {spec.parallel.pp_schedule} keeps "
        f"{'+'.join(str(h) for h in held)} in flight, checkpointing {spec.memory.activation_checkpointing}; "
        "buffers include a stage input and its gradient per stage",
    ]
    memory = device_plan(spec, states, activations, kept=kept, world=world, kind=kind, notes=notes)
    return RankPlan(
        pp_rank=pp_rank,
        stages=stages,
        layers=layers,
        embedding=embedding,
        head=head,
        num_params=counts.total,
        in_flight=held,
        memory=memory,
    )


def pipeline_plan(
    spec: RunSpec, layout: PipelineLayout, world: int | None = None, device_type: str | None = None
) -> PipelinePlan:
    """Every pipeline rank's plan of `spec` on `world` ranks (default: the spec's own)."""
    from launcher.components.device import resolve_device

    n = world or max(spec.launcher.world_size, 1)
    kind = device_type or resolve_device(spec.launcher.device)
    ranks = tuple(rank_plan(spec, layout, r, n, kind) for r in range(len(layout.rank_stages)))
    return PipelinePlan(
        schedule=spec.parallel.pp_schedule,
        microbatches=spec.parallel.pp_microbatches,
        stages_per_rank=len(layout.rank_stages[0]),
        bubble=layout.bubble,
        ranks=ranks,
    )
