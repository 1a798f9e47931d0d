"""Which runs build the model on the meta device (launcher.components.model.meta_init), without torch:
the rank decides with it, and the planner counts the build with the same answer."""

from __future__ import annotations

from launcher.components.model.family import family
from launcher.config.memory import MemoryConfig
from launcher.config.model import ModelConfig
from launcher.config.objective import ObjectiveConfig
from launcher.config.precision import PrecisionConfig
from launcher.config.prune import PruneConfig
from launcher.config.qat import QatConfig
from launcher.config.quantization import QuantizationConfig


def builds_on_meta(
    model: ModelConfig,
    *,
    splits: bool,
    quantization: QuantizationConfig,
    qat: QatConfig,
    prune: PruneConfig,
    precision: PrecisionConfig,
    objective: ObjectiveConfig,
    memory: MemoryConfig,
) -> bool:
    """Whether a rank builds the model on the meta device: a family that replays its init there (the GPT), split by a strategy (`splits`:
    FSDP2, TP or a pipeline), and nothing before the wrap needs its values (quantization, adapters, QAT,
    pruning masks, fp8 layers, pure bf16's cast, a preference reference copy, the micro-batch search). A Hugging Face model
    built from its config initialises through `.data` aliases and, for some, `trunc_normal_`'s in-place
    arithmetic, which this replay cannot follow: it is built eagerly (a pretrained folder is read into
    the shards instead, launcher.parallel.pretrained)."""
    return (
        family(model).init_on_meta(model)
        and splits
        and quantization.method == "none"
        and quantization.lora.rank == 0
        and qat.scheme == "none"
        and prune.method == "none"
        and not precision.fp8
        and precision.param_dtype == "fp32"
        and objective.name == "sft"
        and not memory.auto_micro_batch
    )
