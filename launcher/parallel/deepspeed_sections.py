"""What becomes of each top-level section of a user's DeepSpeed JSON: honoured, decided by the spec, or refused.

DeepSpeed 0.19.8 reads the top-level keys listed here (`deepspeed/runtime/config.py` and the
configs it builds) and ignores any other silently. A section is one of three:

- decided by the spec (SPEC_DECIDES): the launcher generates it from the spec, and a user's value
  is checked against the spec (launcher.parallel.deepspeed_user_config) or replaced by the
  launcher's own value;
- honoured (HONOURED): handed to DeepSpeed as written; its values are checked against DeepSpeed's
  own config models before launch (launcher.parallel.deepspeed_schema);
- refused (REFUSED): a DeepSpeed feature that a launcher run would lose, misapply or die in, each with
  the launcher's way to get it. An unknown key (a misspelling) is refused too, as DeepSpeed would
  ignore it.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from launcher.spec import SpecError

SPEC_DECIDES: dict[str, str] = {
    "train_batch_size": "train.micro_batch_size x train.grad_accum_steps x ranks",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "gradient_clipping": "train.max_grad_norm",
    "fp16": "precision.fp16 and its loss scaling (precision.loss_scale_*)",
    "bf16": "precision.bf16",
    "bfloat16": "precision.bf16",
    "optimizer": "the optimizer group (checked against it, then dropped: a client optimizer)",
    "scheduler": "the scheduler group (checked against it, then dropped: the loop steps the schedule)",
    "zero_allow_untested_optimizer": "the launcher (true: the optimizer group's torch optimizer)",
    "zero_force_ds_cpu_optimizer": "the launcher (false: the optimizer group's torch optimizer)",
    "steps_per_print": "the launcher (DeepSpeed stays quiet; the loop writes metrics.jsonl)",
}
"""Sections the spec decides, and what decides them."""

HONOURED: dict[str, str] = {
    "zero_optimization": "ZeRO: stage and offload checked against parallel.*, the rest (buckets, overlap, stage3_*) as written",
    "communication_data_type": "the dtype of gradient reductions",
    "seq_parallel_communication_data_type": "the dtype of sequence-parallel reductions",
    "prescale_gradients": "gradients divided before the all-reduce",
    "gradient_predivide_factor": "the factor gradients are divided by before the all-reduce",
    "gradient_allreduce_op": "mean or sum reduction of gradients",
    "disable_allgather": "reduce-scatter instead of all-gather (ZeRO-1/2)",
    "sparse_gradients": "sparse embedding gradients",
    "data_types": "the gradient accumulation dtype (grad_accum_dtype)",
    "checkpoint": "tag validation and DeepSpeed's checkpoint reads",
    "aio": "asynchronous I/O settings (NVMe offload only)",
    "wall_clock_breakdown": "DeepSpeed's timers",
    "memory_breakdown": "DeepSpeed's memory log",
    "dump_state": "DeepSpeed prints its state at start",
    "comms_logger": "DeepSpeed's communication log",
    "timers": "DeepSpeed's throughput timers",
    "log_level": "DeepSpeed's log level",
    "dataloader_drop_last": "DeepSpeed's own data loader, which a launcher run does not use",
    "vocabulary_size": "a tensor-core alignment warning",
    "use_data_before_expert_parallelism": "the order of data and expert groups (no experts: nothing)",
}
"""Sections handed to DeepSpeed as written, and what they do."""

_PRECISION = "The launcher's precision group decides the dtypes: use `precision=bf16` or `precision=fp16`"
_NO_COUNTERPART = "the launcher has no counterpart for it"
_CHECKPOINTS = (
    "another checkpoint engine, while the launcher writes every checkpoint itself (atomically, with a "
    "manifest) through DeepSpeed's default engine"
)
REFUSED: dict[str, str] = {
    "compile": (
        "DeepSpeed's compile section (DeepCompile; axolotl's torch_compile files write torch.compile's "
        "arguments there, which DeepSpeed 0.19.8 refuses at start). The launcher compiles the model itself: "
        "remove the section and use the compile group (`compile=default`, `compile=max_autotune`, "
        "`compile.mode=reduce_overhead`)"
    ),
    "torch_autocast": f"DeepSpeed's autocast. {_PRECISION}",
    "amp": f"apex AMP. {_PRECISION}",
    "tensor_parallel": "AutoTP. The launcher owns tensor parallelism: `parallel=tp parallel.tp_size=N`",
    "pipeline": "DeepSpeed's pipeline engine. The launcher's pipeline is `parallel=pp parallel.pp_size=N`",
    "sequence_parallel_size": "Ulysses sequence parallelism. The launcher's is `parallel.cp_size=N`",
    "expert_parallel": f"DeepSpeed's AutoEP; {_NO_COUNTERPART} under DeepSpeed",
    "activation_checkpointing": (
        "DeepSpeed's activation checkpointing, which only acts where model code calls "
        "deepspeed.checkpointing (the launcher's models do not). Use "
        "`memory=checkpoint_all` (memory.activation_checkpointing=blocks)"
    ),
    "flops_profiler": "DeepSpeed's profiler. Use `profile=true` (torch.profiler) and the `mfu` metric",
    "tensorboard": "DeepSpeed's monitor. The launcher logs through its logger group: `logger=tensorboard`",
    "wandb": "DeepSpeed's monitor. The launcher logs through its logger group: `logger=wandb`",
    "csv_monitor": "DeepSpeed's monitor. The launcher writes RUN_DIR/metrics.jsonl",
    "comet": f"DeepSpeed's monitor; {_NO_COUNTERPART}: the launcher writes RUN_DIR/metrics.jsonl",
    "autotuning": "DeepSpeed's autotuner, run by the `deepspeed` launcher only. Use `memory.auto_micro_batch=true`",
    "elasticity": "DeepSpeed's elastic batch sizes. Restarts are `launcher.max_restarts`",
    "managed_gradient_accumulation": "the loop drives accumulation itself (train.grad_accum_steps)",
    "disable_python_gc": "the launcher runs Python's collector at the loop's pauses itself",
    "hybrid_engine": f"DeepSpeed-Chat's generation engine; {_NO_COUNTERPART}",
    "graph_harvesting": f"CUDA-graph capture of the hybrid engine; {_NO_COUNTERPART}",
    "data_efficiency": f"DeepSpeed's data sampling and routing; {_NO_COUNTERPART} (the data group feeds the loop)",
    "curriculum_learning": f"DeepSpeed's curriculum; {_NO_COUNTERPART} (the data group feeds the loop)",
    "sparse_attention": f"DeepSpeed's sparse attention kernels; {_NO_COUNTERPART}",
    "progressive_layer_drop": f"progressive layer drop; {_NO_COUNTERPART}",
    "eigenvalue": f"DeepSpeed's eigenvalue computation; {_NO_COUNTERPART}",
    "quantize_training": "DeepSpeed's quantized training. Use the qat group (qat.scheme)",
    "compression_training": "DeepSpeed's compression. Use the qat or prune groups",
    "weight_quantization": "DeepSpeed's weight quantization. Use the quantization group",
    "datastates_ckpt": _CHECKPOINTS,
    "nebula": _CHECKPOINTS,
}
"""Sections refused before launch, and why, with the launcher's way to get the same."""

KNOWN = {**SPEC_DECIDES, **HONOURED, **REFUSED}
"""Every top-level key DeepSpeed 0.19.8 reads."""


def verdict(key: str) -> str:
    """decided, honoured, refused or unknown, for a top-level key of a DeepSpeed JSON."""
    if key in SPEC_DECIDES:
        return "decided"
    if key in HONOURED:
        return "honoured"
    return "refused" if key in REFUSED else "unknown"


def section_problems(path: str, user: dict[str, Any]) -> list[SpecError]:
    """One error per refused or unknown top-level section of the user's DeepSpeed config."""
    errors = []
    for key, value in user.items():
        kind = verdict(key)
        if kind == "refused" and key != "tensor_parallel":  # AutoTP: its own check names the size
            shown = json.dumps(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            errors.append(
                SpecError(
                    (f"deepspeed_config:{key}",),
                    f"the DeepSpeed JSON {path} has a `{key}` section ({shown}): {REFUSED[key]}. Remove the "
                    "section from the JSON (each section DeepSpeed reads is listed in docs/deepspeed.md).",
                )
            )
        elif kind == "unknown":
            near = difflib.get_close_matches(key, list(KNOWN), n=1)
            hint = f" Did you mean `{near[0]}`?" if near else ""
            errors.append(
                SpecError(
                    (f"deepspeed_config:{key}",),
                    f"the DeepSpeed JSON {path} has a key `{key}` that DeepSpeed does not read: it would be "
                    f"ignored without a word.{hint} Fix the name or remove the key.",
                )
            )
    return errors
