"""Rules of pipeline parallelism (parallel.pp_size > 1: stages over the outermost mesh axis), checked before launch.

A pipeline composes with the data-parallel strategies single, ddp and fsdp (and strategy pp, the
alias of fsdp inside stages, plain stages on one data-parallel rank); DeepSpeed and strategy tp
alone refuse it, and pipeline keys without a pipeline are refused. Each schedule takes the stages per rank and the micro
batches that torch.distributed.pipelining's schedule class accepts (torch 2.13, read from its
source: Schedule1F1B needs micro batches >= stages, ScheduleInterleaved1F1B a multiple of its
rounds, ScheduleZBVZeroBubble exactly two stages per rank, ScheduleGPipe nothing); the model has
a layer for every stage; and what a pipeline cannot run yet is refused. Its mesh degrees and its
FSDP2 and tensor-parallel keys are launcher.rules.sharding's, resuming across it
launcher.rules.resume's.
"""

from __future__ import annotations

from collections.abc import Iterator

from launcher.config.parallel import ParallelConfig
from launcher.parallel.pipeline_split import SCHEDULES, split_problem
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError

PP_KEYS = ("pp_size", "pp_schedule", "pp_microbatches", "pp_stages_per_rank", "pp_split")
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
"""Schedules whose torch class takes one stage per rank (ScheduleGPipe, Schedule1F1B)."""
PRESETS = "`parallel.pp_size=2` with `parallel=single`, `ddp` or `fsdp` (or the presets `parallel=pp`, `pp_fsdp`, `pp_tp_fsdp`)"
PIPELINED = ("single", "ddp", "fsdp", "pp")
"""Strategies a pipeline composes with: the data-parallel wrap inside each stage (pp: the fsdp alias)."""
_DEFAULTS = ParallelConfig()
_WHY_NOT = {
    "tp": (
        "strategy tp is tensor parallelism over all ranks, with no room for stages; tensor parallelism "
        "inside stages is `parallel=fsdp parallel.tp_size=2 parallel.pp_size=2` (or the preset pp_tp_fsdp)"
    ),
    "deepspeed": (
        "DeepSpeed's engine owns the backward pass, and ZeRO-2/3 partition gradients and parameters once "
        "per step, which a pipeline's backward per micro batch on each stage breaks"
    ),
}


def _pipeline(spec: RunSpec) -> bool:
    """Whether the spec runs a pipeline (every rule here but the first two is about one alone)."""
    return spec.parallel.pp_size > 1 or spec.parallel.strategy == "pp"


def _foreign_keys(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p = spec.parallel
    if p.strategy == "pp" and p.pp_size < 2:
        yield SpecError(
            ("parallel.strategy", "parallel.pp_size"),
            f"strategy pp splits the layers into pipeline stages on different ranks, so it needs pp_size >= 2 "
            f"(got {p.pp_size}). Set `parallel.pp_size=2` (and launcher.nproc to a multiple of it), or use "
            "`parallel=fsdp` to shard without a pipeline.",
        )
        return
    if _pipeline(spec) and p.strategy not in PIPELINED:
        why = _WHY_NOT.get(p.strategy, f"parallel.strategy={p.strategy} runs every layer on every rank")
        yield SpecError(
            ("parallel.strategy", "parallel.pp_size"),
            f"parallel.pp_size={p.pp_size} asks for a pipeline, but parallel.strategy={p.strategy} does not run "
            f"inside pipeline stages: {why}. Use {PRESETS}, or parallel.pp_size=1.",
        )
        return
    if _pipeline(spec):
        return
    keys = [f"parallel.{n}" for n in PP_KEYS[1:] if getattr(p, n) != getattr(_DEFAULTS, n)]
    if not keys or p.pp_size < 1:
        return  # pp_size below 1: the mesh's rule (parallel.dims) names it
    yield SpecError(
        ("parallel.pp_size", *keys),
        f"{', '.join(keys)} configure pipeline parallelism, but parallel.pp_size is 1 (no pipeline), so nothing "
        f"reads them. Set parallel.pp_size=2 or more for a pipeline ({PRESETS}), or leave these keys at their defaults.",
    )


def _stages_per_rank(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p = spec.parallel
    if not _pipeline(spec) or p.pp_schedule not in SCHEDULES:
        return  # an unknown schedule is launcher.rules.choices'
    keys = ("parallel.pp_stages_per_rank", "parallel.pp_schedule")
    v, schedule = p.pp_stages_per_rank, p.pp_schedule
    if v < 1:
        yield SpecError(("parallel.pp_stages_per_rank",), f"must be at least 1, got {v}.")
    elif schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        yield SpecError(
            keys,
            f"pp_schedule={schedule} places one stage on each rank (torch's "
            f"{'ScheduleGPipe' if schedule == 'gpipe' else 'Schedule1F1B'} takes a single stage), but "
            f"pp_stages_per_rank={v}. Set parallel.pp_stages_per_rank=1, or use "
            "parallel.pp_schedule=interleaved_1f1b for several stages per rank.",
        )
    elif schedule == "interleaved_1f1b" and v < 2:
        yield SpecError(
            keys,
            "pp_schedule=interleaved_1f1b loops each rank over several stages (that is what shrinks its "
            "bubble); with pp_stages_per_rank=1 it is plain 1f1b. Set parallel.pp_stages_per_rank=2 (or more), "
            "or parallel.pp_schedule=1f1b.",
        )
    elif schedule == "zero_bubble" and v != 2:
        yield SpecError(
            keys,
            "pp_schedule=zero_bubble is torch's ScheduleZBVZeroBubble, which places exactly two stages on "
            f"each rank in a V (rank r holds stages r and 2 x pp_size - 1 - r) and refuses any other count, "
            f"but pp_stages_per_rank={v}. Set parallel.pp_stages_per_rank=2.",
        )


def _microbatches(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p = spec.parallel
    if not _pipeline(spec):
        return
    n, pp = p.pp_microbatches, p.pp_size
    if n < 1:
        yield SpecError(
            ("parallel.pp_microbatches",),
            f"must be at least 1 (the pipeline micro batches each train.micro_batch_size batch is cut into), got {n}.",
        )
        return
    if p.pp_schedule == "1f1b" and n < pp:
        yield SpecError(
            ("parallel.pp_microbatches", "parallel.pp_size", "parallel.pp_schedule"),
            f"torch's Schedule1F1B refuses fewer micro batches than pipeline stages: in its steady state every "
            f"stage works on a micro batch of its own, so parallel.pp_microbatches ({n}) must be at least "
            f"parallel.pp_size ({pp}). Set parallel.pp_microbatches={pp} or more (dividing "
            "train.micro_batch_size), or parallel.pp_schedule=gpipe.",
        )
    if p.pp_schedule == "interleaved_1f1b" and pp >= 1 and n % pp:
        b = spec.train.micro_batch_size
        dividing = [m for m in range(pp, b + 1, pp) if b % m == 0]
        if dividing:
            fix = f"Set parallel.pp_microbatches={min(dividing, key=lambda m: abs(m - n))}"
        else:  # no multiple of pp_size divides the micro batch: both must change
            fix = (
                f"No multiple of {pp} divides train.micro_batch_size ({b}): set both, e.g. "
                f"train.micro_batch_size={b * pp} parallel.pp_microbatches={pp}"
            )
        yield SpecError(
            ("parallel.pp_microbatches", "parallel.pp_size", "parallel.pp_schedule"),
            f"interleaved_1f1b sends the micro batches through each rank's stages in rounds of pp_size, and this "
            f"launcher runs whole rounds only (Megatron's rule), so parallel.pp_microbatches ({n}) must be a "
            f"multiple of parallel.pp_size ({pp}); torch's ScheduleInterleaved1F1B itself needs a multiple of "
            f"max(1, pp_microbatches // pp_size) and refuses e.g. {2 * pp + 1}. {fix} (the pipeline micro "
            f"batches must also divide train.micro_batch_size).",
        )


def _batch_split(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p, b = spec.parallel, spec.train.micro_batch_size
    if not _pipeline(spec) or p.pp_microbatches < 1:
        return
    if spec.data.batching == "token_budget":
        yield SpecError(
            ("data.batching", "parallel.strategy"),
            "token_budget batches vary in their number of sequences, but a pipeline cuts each batch into "
            "parallel.pp_microbatches equal micro batches whose shapes the stages exchange. Use "
            "data.batching=fixed with train.micro_batch_size under strategy pp.",
        )
    elif b >= 1 and b % p.pp_microbatches:
        fixed = -(-b // p.pp_microbatches) * p.pp_microbatches
        yield SpecError(
            ("train.micro_batch_size", "parallel.pp_microbatches"),
            f"each train.micro_batch_size batch ({b} sequences) is cut into parallel.pp_microbatches "
            f"({p.pp_microbatches}) equal pipeline micro batches (gradient accumulation runs whole pipeline "
            f"steps), so it must be a multiple of pp_microbatches. Set train.micro_batch_size={fixed}, or "
            f"parallel.pp_microbatches to a divisor of {b}.",
        )


def _layers(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    from launcher.components.model.shape import model_shape

    p = spec.parallel
    if not _pipeline(spec) or p.pp_size < 1 or p.pp_stages_per_rank < 1:
        return
    try:
        n_layer = model_shape(spec.model).equivalent.n_layer
    except (OSError, ValueError, KeyError):
        return  # launcher.rules.hf_model says what is wrong with the model folder
    num_stages = p.pp_size * p.pp_stages_per_rank
    problem = split_problem(n_layer, num_stages, p.pp_split)
    if problem is None:
        return
    depth = ("model.n_layer",) if spec.model.kind == "gpt" else ("model.path", "model.hf_config")
    if num_stages > n_layer:
        yield SpecError(
            ("parallel.pp_size", "parallel.pp_stages_per_rank", *depth),
            f"{problem}: pp_size ({p.pp_size}) x pp_stages_per_rank ({p.pp_stages_per_rank}). Lower "
            "parallel.pp_size or parallel.pp_stages_per_rank, or use a model with more layers.",
        )
        return
    even = [n_layer * s // num_stages for s in range(1, num_stages)]
    yield SpecError(
        ("parallel.pp_split", "parallel.pp_size", "parallel.pp_stages_per_rank"),
        f"parallel.pp_split={list(p.pp_split or [])} does not split {n_layer} layers into {num_stages} stages: "
        f"{problem}. Give the first layer of each stage after the first, e.g. "
        f"parallel.pp_split=[{','.join(map(str, even))}], or parallel.pp_split=null for a balanced split.",
    )


def _unsupported(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    if not _pipeline(spec):
        return
    p, q = spec.parallel, spec.quantization
    if spec.memory.auto_micro_batch:
        yield SpecError(
            ("memory.auto_micro_batch", "parallel.strategy"),
            "the micro-batch search runs the whole model's forward and backward on one device, but under a "
            "pipeline each rank holds only its stages and runs each batch as parallel.pp_microbatches pieces: "
            "not supported under a pipeline yet. Set memory.auto_micro_batch=false and choose "
            "train.micro_batch_size by hand (a multiple of pp_microbatches), or use `parallel=fsdp`.",
        )
    if p.sequence_parallel:
        yield SpecError(
            ("parallel.sequence_parallel", "parallel.strategy"),
            "sequence parallelism is not supported under a pipeline yet (tensor parallelism inside a stage "
            "is, with parallel.tp_size). Set parallel.sequence_parallel=false, or use `parallel=tp_fsdp` for it.",
        )
    if q.method != "none":
        yield SpecError(
            ("quantization.method", "parallel.strategy"),
            f"{q.method} weights are not supported under a pipeline yet; use `parallel=fsdp` (nf4 through "
            "torchao's shardable NF4 tensors) or `parallel=ddp`, or `quantization=none` with strategy pp.",
        )
    if q.lora.rank > 0:
        yield SpecError(
            ("quantization.lora.rank", "parallel.strategy"),
            "LoRA/DoRA adapters are not supported under a pipeline yet; use `parallel=fsdp` (or ddp) for "
            "adapter training, or quantization.lora.rank=0 with strategy pp.",
        )


def _hf_layout(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    """A Hugging Face model is cut into stages along the Llama layout (embed_tokens, layers, norm, lm_head)."""
    if not _pipeline(spec) or spec.model.kind != "hf":
        return
    from launcher.components.model.hf import build_hf_model, pipeline_problem

    try:
        problem = pipeline_problem(build_hf_model(spec.model, empty=True, announce=False).hf)
    except (OSError, ValueError, KeyError):
        return  # launcher.rules.hf_model says what is wrong with the model folder
    if problem:
        yield SpecError(
            ("parallel.strategy", "model.path", "model.hf_config"),
            f"{problem}, so pipeline stages cannot hold it. Use `parallel=fsdp` (or ddp, or a DeepSpeed "
            "ZeRO option) with parallel.pp_size=1 for this model.",
        )


RULES: tuple[Rule, ...] = (
    _foreign_keys,
    _stages_per_rank,
    _microbatches,
    _batch_split,
    _layers,
    _unsupported,
    _hf_layout,
)
"""This module's rules, in the order they report."""
