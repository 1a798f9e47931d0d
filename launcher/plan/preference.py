"""What a preference objective (launcher.components.objectives.preference) adds to a rank's memory, beside its doubled batch.

The planner counts a paired objective's micro batch as 2 x train.micro_batch_size rows (chosen and
rejected: launcher.plan.planner.activation_shape). This term adds the frozen reference's weights
(none with LoRA, whose reference is the base with adapters off, none for simpo and orpo), the
reference's logits of the micro batch (none when its log-probs are precomputed), and the float32
log-softmax of the policy's logits that the row log-probs are read from.
"""

from __future__ import annotations

from launcher.components.model.shape import model_shape
from launcher.components.objectives import objective_module
from launcher.config.model import vocab_size
from launcher.config.objective import rows_per_example
from launcher.spec import RunSpec


def preference_reference(spec: RunSpec) -> tuple[int, str] | None:
    """The reference's weights (training dtype; sharded under FSDP2) and logits, and the float32 log-probs of the rows.

    The reference is the one the objective's module declares (launcher.components.objectives), as the rank places it.
    """
    o = spec.objective
    if o.name == "sft":
        return None
    declared = objective_module(o, spec.distill).frozen_model(
        o, spec.distill, adapters=spec.quantization.lora.rank > 0
    )
    dtype_bytes = 2 if spec.precision.bf16 or spec.precision.fp16 else 4
    rows = spec.train.micro_batch_size * rows_per_example(o.name)
    cells = rows * spec.data.seq_len * vocab_size(spec.model)
    each_step = declared is not None and not declared.precomputed
    if declared is None:
        weights, note = 0, "reference: none (none needed)"
    elif declared.precomputed:
        weights, note = 0, "reference: none (log-probs precomputed once)"
    elif declared.source == "adapters_off":
        weights, note = 0, "reference: none (the base, adapters off)"
    else:
        shards = max(spec.launcher.world_size, 1) if spec.parallel.method.shards else 1
        num_params = model_shape(spec.model).num_params
        weights = num_params * dtype_bytes // shards
        note = f"reference copy: {num_params:,} weights x {dtype_bytes} B" + (
            f" / {shards} FSDP2 shards" if shards > 1 else ""
        )
    logits = cells * dtype_bytes if each_step else 0
    return (
        weights + logits + cells * 4,
        f"objective={o.name}: {note}, {rows} rows' logits and float32 log-probs",
    )
