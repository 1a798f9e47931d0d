"""Rules of the `fsdp` and `tp` strategies, checked before launch: mesh degrees against the world
size (through launcher.parallel.dims, their one owner) and the model's shape, options that only
one of them reads, fp16's scaler. Strategy `pp` reads the FSDP2 keys and tp_size too (FSDP2 and
tensor parallelism inside each stage), so its degrees and tensor-parallel shapes are checked here;
its pipeline keys are launcher.rules.pipeline's. Resuming a sharded (DCP) checkpoint is
launcher.rules.resume's."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.config.parallel import ParallelConfig
from launcher.parallel.dims import degree_errors
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError

DTENSOR_STRATEGIES = ("fsdp", "tp")
MESH_STRATEGIES = (*DTENSOR_STRATEGIES, "pp")
"""Strategies laid out on launcher.parallel.dims' mesh: their degrees, FSDP2 and tp_size keys are checked here."""
FSDP_STRATEGIES = ("fsdp", "pp")
"""Strategies that read the FSDP2 keys (pp shards each stage over its data-parallel ranks)."""
FSDP_KEYS = ("reshard_after_forward", "replicate_degree", "cpu_offload", "prefetch_layers")
TP_KEYS = ("tp_size", "sequence_parallel")
_DEFAULTS = ParallelConfig()


def _changed(p: ParallelConfig, names: tuple[str, ...]) -> list[str]:
    return [f"parallel.{n}" for n in names if getattr(p, n) != getattr(_DEFAULTS, n)]


def _foreign_keys(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p = spec.parallel
    if p.strategy == "deepspeed":  # its own rules name what it ignores
        return
    fsdp_keys = [] if p.strategy in FSDP_STRATEGIES else _changed(p, FSDP_KEYS)
    # pp reads tp_size; its sequence_parallel is refused by launcher.rules.pipeline.
    tp_keys = [] if p.strategy in MESH_STRATEGIES else _changed(p, TP_KEYS)
    if fsdp_keys:
        yield SpecError(
            ("parallel.strategy", *fsdp_keys),
            f"{', '.join(fsdp_keys)} configure FSDP2, but parallel.strategy={p.strategy} ignores them. "
            "Use `parallel=fsdp` (or fsdp_shard_grad_op, fsdp_hybrid, fsdp_offload), or leave them at their defaults.",
        )
    if tp_keys:
        yield SpecError(
            ("parallel.strategy", *tp_keys),
            f"{', '.join(tp_keys)} configure tensor parallelism, but parallel.strategy={p.strategy} ignores them. "
            "Use `parallel=tp` (tensor parallel over all ranks) or `parallel=tp_fsdp` (FSDP2 x tensor parallel).",
        )


def _degrees(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p, world_size = spec.parallel, spec.launcher.world_size
    if p.strategy not in MESH_STRATEGIES and p.pp_size == 1:
        return
    if p.prefetch_layers < 0:
        yield SpecError(("parallel.prefetch_layers",), f"must be 0 or more, got {p.prefetch_layers}.")
    yield from degree_errors(p, world_size)
    if p.strategy == "tp" and (p.tp_size < 2 or world_size != p.tp_size):
        fix = (
            f"Set `parallel.tp_size={world_size}`"
            if world_size >= 2
            else "Run it on several ranks (`launcher=local launcher.nproc=2`)"
        )
        yield SpecError(
            ("parallel.strategy", "parallel.tp_size", "launcher.nproc"),
            f"strategy tp splits every layer over all ranks, so it needs tp_size = world size >= 2 (got "
            f"tp_size {p.tp_size}, world size {world_size}). {fix}, or use `parallel=tp_fsdp` to add "
            "data parallelism on top.",
        )


def _hf_tp(spec: RunSpec) -> Iterator[SpecError]:
    """Tensor parallelism of a Hugging Face model: its config's own plan, and heads and width that split evenly."""
    from launcher.components.model.hf_files import hf_config, llama_layout, tp_plan_problem

    p = spec.parallel
    try:
        config = hf_config(spec.model)
    except (OSError, ValueError, KeyError):
        return  # launcher.rules.hf_model says what is wrong with the folder
    problem = tp_plan_problem(config)
    if problem:
        yield SpecError(
            ("parallel.tp_size", "model.path", "model.hf_config"),
            f"{problem}, so parallel.tp_size={p.tp_size} cannot split it. Use `parallel=fsdp` (or ddp, or a "
            "DeepSpeed ZeRO option) for this model; Llama, Qwen2, Mistral and their relatives carry a plan.",
        )
        return
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    width = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    if heads % p.tp_size or kv_heads % p.tp_size or width % p.tp_size:
        yield SpecError(
            ("parallel.tp_size", "model.path", "model.hf_config"),
            f"tensor parallelism gives each rank whole heads and an equal slice of the MLP, so the model's attention "
            f"heads ({heads}), key-value heads ({kv_heads}) and MLP width ({width}) must be multiples of "
            f"parallel.tp_size ({p.tp_size}). Choose a tp_size that divides them.",
        )
    if p.sequence_parallel and p.strategy != "pp" and not llama_layout(config):  # pp: launcher.rules.pipeline
        yield SpecError(
            ("parallel.sequence_parallel", "model.kind"),
            f"sequence parallelism of a Hugging Face model splits Llama-style decoder layers (self_attn.* and "
            f"mlp.* in the config's tensor-parallel plan); {type(config).__name__}'s plan is laid out otherwise. "
            "Set parallel.sequence_parallel=false.",
        )


def _sequence_split(spec: RunSpec) -> Iterator[SpecError]:
    """Sequence parallelism cuts every sequence into tp_size equal parts."""
    p = spec.parallel
    if not p.sequence_parallel or p.strategy == "pp":  # pp refuses it (launcher.rules.pipeline)
        return
    if spec.data.seq_len % p.tp_size:
        yield SpecError(
            ("parallel.sequence_parallel", "data.seq_len"),
            f"sequence parallelism splits each sequence into {p.tp_size} equal parts, so data.seq_len "
            f"({spec.data.seq_len}) must be a multiple of parallel.tp_size.",
        )
    if not spec.data.packing:
        yield SpecError(
            ("parallel.sequence_parallel", "data.packing"),
            "sequence parallelism needs every batch to be data.seq_len long, but unpacked batches are as long as "
            "their longest document. Set data.packing=true, or parallel.sequence_parallel=false.",
        )


def _model_shape(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p, m = spec.parallel, spec.model
    if p.strategy not in MESH_STRATEGIES or p.tp_size <= 1:
        return
    yield from _sequence_split(spec)
    if m.kind == "hf":
        yield from _hf_tp(spec)
        return
    d_ff = m.d_ff if m.d_ff is not None else 4 * m.d_model
    if m.n_head % p.tp_size or d_ff % p.tp_size:
        yield SpecError(
            ("parallel.tp_size", "model.n_head", "model.d_ff"),
            f"tensor parallelism gives each rank whole heads and an equal slice of the MLP, so model.n_head "
            f"({m.n_head}) and the MLP width ({d_ff}) must be multiples of parallel.tp_size ({p.tp_size}).",
        )


def _combinations(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p = spec.parallel
    if p.strategy not in DTENSOR_STRATEGIES:
        return
    if p.sequence_parallel and p.tp_size < 2:
        yield SpecError(
            ("parallel.sequence_parallel", "parallel.tp_size"),
            "sequence parallelism splits the activations between tensor-parallel regions, so it needs "
            "parallel.tp_size >= 2. Set parallel.tp_size, or parallel.sequence_parallel=false.",
        )
    if spec.precision.fp16 and spec.optimizer.implementation == "fused":
        yield SpecError(
            ("precision.fp16", "optimizer.implementation", "parallel.strategy"),
            f"fp16 with parallel.strategy={p.strategy} uses torch's ShardedGradScaler (its overflow flag is "
            "all-reduced so every rank skips together), whose flag the fused optimizer kernel cannot take. "
            "Use optimizer.implementation=foreach (or auto), or `precision=bf16`, which needs no scaler.",
        )


RULES: tuple[Rule, ...] = (_foreign_keys, _degrees, _model_shape, _combinations)
"""This module's rules, in the order they report."""
