"""What the compression techniques (pruning, QAT, distillation) and a preference reference add to a rank's memory.

Each term is (bytes, note) for one rank of the spec, counted from the config without building
anything; `extra_bytes` sums them for launcher.plan.planner, which adds them to the buffers and
prints the notes in the dry run's plan.
"""

from __future__ import annotations

from pathlib import Path

from launcher.components.model.shape import model_shape
from launcher.components.qat import scale_bytes
from launcher.config.distill import KD_CHUNK_ROWS
from launcher.config.model import ModelConfig, vocab_size
from launcher.config.qat import SCALE_BYTES
from launcher.plan.preference import preference_reference
from launcher.plan.rollouts import rollout_cache
from launcher.spec import RunSpec, load_spec

PRUNE_MASK_BYTES = 1
"""Bytes per weight of a pruned layer: launcher.components.prune keeps each mask as a uint8 buffer."""


KD_CHUNK_COPIES = 6
"""float32 (rows x vocab) tensors of one KL chunk: both models' upcast logits, log-softmaxes, a probability, the product."""


def prune_masks(spec: RunSpec) -> tuple[int, str] | None:
    """The prune masks: 1 byte per weight of the blocks' linear layers, on every rank (single and DDP)."""
    if spec.prune.method == "none":
        return None
    shape = model_shape(spec.model)
    per_layer = sum(fan_in * fan_out for fan_in, fan_out in shape.block_linears.values())
    weights = per_layer * shape.equivalent.n_layer
    return weights * PRUNE_MASK_BYTES, f"prune masks: {weights:,} weights x {PRUNE_MASK_BYTES} B (uint8)"


def qat_scales(spec: RunSpec) -> tuple[int, str] | None:
    """QAT's fake-quant scales and zero points: one fp32 + one int32 per weight group, recomputed each forward."""
    if spec.qat.scheme == "none":
        return None
    shape = model_shape(spec.model)
    layers = [
        (fan_out, fan_in) for fan_in, fan_out in shape.block_linears.values()
    ] * shape.equivalent.n_layer
    num = scale_bytes(layers, spec.qat)
    groups = num // (2 * SCALE_BYTES)
    return (
        num,
        f"QAT fake-quant scales: {groups:,} groups of {spec.qat.group_size} x (4 B scale + 4 B zero point)",
    )


def teacher_model(path: str) -> ModelConfig | None:
    """The teacher's model config: a run directory's spec.yaml, or a Hugging Face folder; None if neither."""
    folder = Path(path)
    if (folder / "spec.yaml").is_file():
        return load_spec(folder / "spec.yaml").model
    if (folder / "config.json").is_file():
        return ModelConfig(kind="hf", path=str(folder))
    return None


def distill_teacher(spec: RunSpec) -> tuple[int, str] | None:
    """The frozen teacher's weights (training dtype; sharded under FSDP2), its logits of a micro batch, and one
    float32 chunk of logits per model with their softmax intermediates (launcher.components.objectives.distillation)."""
    if not spec.distill.teacher or (teacher := teacher_model(spec.distill.teacher)) is None:
        return None
    dtype_bytes = 2 if spec.precision.bf16 or spec.precision.fp16 else 4
    shards = max(spec.launcher.world_size, 1) if spec.parallel.method.shards else 1
    num_params = model_shape(teacher).num_params
    weights = num_params * dtype_bytes // shards
    vocab = vocab_size(spec.model)
    logits = spec.train.micro_batch_size * spec.data.seq_len * vocab * dtype_bytes
    chunks = KD_CHUNK_ROWS * vocab * 4 * KD_CHUNK_COPIES
    return weights + logits + chunks, (
        f"distillation teacher: {num_params:,} weights x {dtype_bytes} B"
        + (f" / {shards} FSDP2 shards" if shards > 1 else "")
        + f", its logits ({spec.train.micro_batch_size} x {spec.data.seq_len} x {vocab} x {dtype_bytes} B) and "
        f"{KD_CHUNK_ROWS}-row float32 KL chunks"
    )


TERMS = (prune_masks, qat_scales, distill_teacher, preference_reference, rollout_cache)
"""Every compression term, in the order the plan's notes list them."""


def extra_bytes(spec: RunSpec) -> tuple[int, list[str]]:
    """Bytes the spec's compression techniques add per rank, and a note for each."""
    terms = [term for make in TERMS if (term := make(spec)) is not None]
    return sum(num for num, _ in terms), [note for _, note in terms]
