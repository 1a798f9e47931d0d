"""Rules of the `fsdp` and `tp` strategies, checked before launch: mesh degrees against the world
size and the model's shape, options that only one of them reads, fp16's scaler, and resuming a
sharded checkpoint (DCP) at another world size or with another strategy."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from launcher.groups import checkpoint
from launcher.parallel import ParallelConfig
from launcher.parallel.dtensor import is_dcp_checkpoint
from launcher.rules.core import Hardware, rule
from launcher.spec import RunSpec, SpecError

DTENSOR_STRATEGIES = ("fsdp", "tp")
FSDP_KEYS = ("reshard_after_forward", "replicate_degree", "cpu_offload", "prefetch_layers")
TP_KEYS = ("tp_size", "sequence_parallel")
_DEFAULTS = ParallelConfig()


def world_size(spec: RunSpec) -> int:
    """Ranks the launch backend will start."""
    return spec.launcher.nnodes * spec.launcher.nproc


def _changed(p: ParallelConfig, names: tuple[str, ...]) -> list[str]:
    return [f"parallel.{n}" for n in names if getattr(p, n) != getattr(_DEFAULTS, n)]


@rule
def _foreign_keys(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p = spec.parallel
    if p.strategy == "deepspeed":  # its own rules name what it ignores
        return
    fsdp_keys = [] if p.strategy == "fsdp" else _changed(p, FSDP_KEYS)
    tp_keys = [] if p.strategy in DTENSOR_STRATEGIES else _changed(p, TP_KEYS)
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


@rule
def _degrees(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p, world = spec.parallel, world_size(spec)
    if p.strategy not in DTENSOR_STRATEGIES:
        return
    if p.tp_size < 1 or p.replicate_degree < 1 or p.prefetch_layers < 0:
        yield SpecError(
            ("parallel.tp_size", "parallel.replicate_degree", "parallel.prefetch_layers"),
            f"tp_size ({p.tp_size}) and replicate_degree ({p.replicate_degree}) must be at least 1 and "
            f"prefetch_layers ({p.prefetch_layers}) at least 0.",
        )
        return
    group = p.tp_size * (p.replicate_degree if p.strategy == "fsdp" else 1)
    if world % group:
        yield SpecError(
            ("launcher.nproc", "launcher.nnodes", "parallel.tp_size", "parallel.replicate_degree"),
            f"the world size ({world} = launcher.nnodes x launcher.nproc) must be a multiple of parallel.tp_size "
            f"x parallel.replicate_degree ({p.tp_size} x {p.replicate_degree}). Change launcher.nproc or the degrees.",
        )
    if p.strategy == "tp" and (p.tp_size < 2 or world != p.tp_size):
        yield SpecError(
            ("parallel.strategy", "parallel.tp_size", "launcher.nproc"),
            f"strategy tp splits every layer over all ranks, so it needs tp_size = world size >= 2 (got tp_size "
            f"{p.tp_size}, world size {world}). "
            + (
                f"Set `parallel.tp_size={world}`"
                if world >= 2
                else "Run it on several ranks (`launcher=local launcher.nproc=2`)"
            )
            + ", or use `parallel=tp_fsdp` to add data parallelism on top.",
        )


@rule
def _model_shape(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p, m = spec.parallel, spec.model
    if p.strategy not in DTENSOR_STRATEGIES:
        return
    if m.kind != "gpt":
        yield SpecError(
            ("parallel.strategy", "model.kind"),
            f"parallel.strategy={p.strategy} shards the built-in GPT's blocks (model.kind=gpt); model.kind={m.kind} "
            "is not supported by it. Use `parallel=ddp` or a DeepSpeed option for this model.",
        )
    if p.tp_size <= 1:
        return
    d_ff = m.d_ff if m.d_ff is not None else 4 * m.d_model
    if m.n_head % p.tp_size or d_ff % p.tp_size:
        yield SpecError(
            ("parallel.tp_size", "model.n_head", "model.d_ff"),
            f"tensor parallelism gives each rank whole heads and an equal slice of the MLP, so model.n_head "
            f"({m.n_head}) and the MLP width ({d_ff}) must be multiples of parallel.tp_size ({p.tp_size}).",
        )
    if p.sequence_parallel and spec.data.seq_len % p.tp_size:
        yield SpecError(
            ("parallel.sequence_parallel", "data.seq_len"),
            f"sequence parallelism splits each sequence into {p.tp_size} equal parts, so data.seq_len "
            f"({spec.data.seq_len}) must be a multiple of parallel.tp_size.",
        )
    if p.sequence_parallel and not spec.data.packing:
        yield SpecError(
            ("parallel.sequence_parallel", "data.packing"),
            "sequence parallelism needs every batch to be data.seq_len long, but unpacked batches are as long as "
            "their longest document. Set data.packing=true, or parallel.sequence_parallel=false.",
        )


@rule
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
    q = spec.quantization
    if q.method != "none" or q.lora.rank > 0:
        yield SpecError(
            ("parallel.strategy", "quantization.method", "quantization.lora.rank"),
            f"parallel.strategy={p.strategy} shards plain weights as DTensors; low-bit (bitsandbytes) weights and "
            "LoRA-wrapped layers are not supported by it. Use `parallel=ddp` or `parallel=single` for QLoRA/LoRA.",
        )


def _checkpoint_ranks(path: Path) -> int:
    """Ranks that wrote a checkpoint (each leaves its RNG state file)."""
    return len(list(path.glob("rng_rank*.pt")))


@rule
def _resume_layout(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    if spec.resume is None:
        return
    run_dir = Path(spec.run_dir) if spec.run_dir else None
    found = checkpoint.resolve_resume(spec.resume, run_dir) if spec.resume != "auto" or run_dir else []
    if not found:
        return
    newest, strategy = found[0], spec.parallel.strategy
    sharded, world = is_dcp_checkpoint(newest), world_size(spec)
    if sharded and strategy not in DTENSOR_STRATEGIES:
        yield SpecError(
            ("resume", "parallel.strategy"),
            f"{newest} is a sharded (DCP) checkpoint of strategy fsdp or tp, which parallel.strategy={strategy} "
            "cannot read. Resume with `parallel=fsdp` or `parallel=tp` (DCP reshards to fewer ranks), or convert its "
            f"weights to a full state dict (loads at world size 1) with `train-export {newest} weights.pt`.",
        )
    elif not sharded and strategy in DTENSOR_STRATEGIES:
        yield SpecError(
            ("resume", "parallel.strategy"),
            f"{newest} was not written by fsdp or tp (it holds no dcp/ shards), so parallel.strategy={strategy} "
            "cannot resume it. Resume it with the strategy that wrote it, or convert its weights to a full state "
            f"dict with `train-export {newest} weights.pt`.",
        )
    elif sharded and world > _checkpoint_ranks(newest) > 0:
        yield SpecError(
            ("resume", "launcher.nproc", "launcher.nnodes"),
            f"{newest} was written by {_checkpoint_ranks(newest)} rank(s) and this run has {world}: DCP reshards the "
            "model and optimizer to fewer ranks, but the extra ranks would have no RNG state to continue from. "
            f"Resume with at most {_checkpoint_ranks(newest)} ranks, or convert its weights to a full state dict "
            f"with `train-export {newest} weights.pt`.",
        )
