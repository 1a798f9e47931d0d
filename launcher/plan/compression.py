"""What the compression techniques (issue 14: pruning, QAT, distillation) add to a rank's memory.

Each term is (bytes, note) for one rank of the spec, counted from the config without building
anything; `extra_bytes` sums them for launcher.plan.planner, which adds them to the buffers and
prints the notes in the dry run's plan.
"""

from __future__ import annotations

from launcher.groups.model.shape import model_shape
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


TERMS = (prune_masks,)
"""Every compression term, in the order the plan's notes list them."""


def extra_bytes(spec: RunSpec) -> tuple[int, list[str]]:
    """Bytes the spec's compression techniques add per rank, and a note for each."""
    terms = [term for make in TERMS if (term := make(spec)) is not None]
    return sum(num for num, _ in terms), [note for _, note in terms]
