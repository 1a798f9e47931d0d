"""What the compression techniques (issue 14: pruning, QAT, distillation) add to a rank's memory.

Each term is (bytes, note) for one rank of the spec, counted from the config without building
anything; `extra_bytes` sums them for launcher.plan.planner, which adds them to the buffers and
prints the notes in the dry run's plan.
"""

from __future__ import annotations

from launcher.groups.model.shape import model_shape
from launcher.groups.qat import SCALE_BYTES, scale_bytes
from launcher.spec import RunSpec

PRUNE_MASK_BYTES = 1
"""Bytes per weight of a pruned layer: launcher.groups.prune keeps each mask as a uint8 buffer."""


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


TERMS = (prune_masks, qat_scales)
"""Every compression term, in the order the plan's notes list them."""


def extra_bytes(spec: RunSpec) -> tuple[int, list[str]]:
    """Bytes the spec's compression techniques add per rank, and a note for each."""
    terms = [term for make in TERMS if (term := make(spec)) is not None]
    return sum(num for num, _ in terms), [note for _, note in terms]
