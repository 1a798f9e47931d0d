"""Rank 0's observers of a session, from the spec: log lines off a terminal, then each watching group's."""

from __future__ import annotations

from launcher.components import loggers
from launcher.components.advice import Advisor
from launcher.components.loggers.observers import LogLines, Observer, Observers, RunContext
from launcher.spec import RunSpec


def build_observers(spec: RunSpec, context: RunContext) -> Observers:
    """The observers of this session on rank 0, in the order they see each record."""
    items: list[Observer] = []
    if not context.console.is_terminal and spec.log.progress:
        items.append(LogLines(context))
    items.extend(loggers.build(spec.logger, context))
    items.append(advisor(spec, context))
    return Observers(items)


def advisor(spec: RunSpec, context: RunContext) -> Advisor:
    """The run-time advisor, given plain values from the spec (groups never read a RunSpec)."""
    t, p = spec.train, spec.parallel
    dp_size = max(context.world_size // (max(p.tp_size, 1) * max(p.pp_size, 1) * max(p.cp_size, 1)), 1)
    precision = "bf16" if spec.precision.bf16 else "fp16" if spec.precision.fp16 else "fp32"
    moe = spec.model.moe
    return Advisor(
        context,
        precision=precision,
        global_batch=t.micro_batch_size * t.grad_accum_steps * dp_size,
        lr=spec.optimizer.lr,
        optimizer=spec.optimizer.name,
        enabled=t.advice,
        moe_load_ceiling=moe.num_experts / moe.top_k if moe.num_experts else _folder_load_ceiling(spec),
        moe_folder=not moe.num_experts,  # any MoE layers are a folder's
    )


def _folder_load_ceiling(spec: RunSpec) -> float:
    """A Hugging Face MoE folder's highest per-layer load (experts over experts per token); 0: none or no folder."""
    from launcher.components.model import hf_experts, hf_files

    folder = hf_files.local_dir(spec.model)  # None for a family without folders
    if folder is None:
        return 0.0
    config = hf_files.read_local_config(folder)
    experts, top_k = hf_experts.num_experts(config), hf_experts.experts_per_token(config)
    return experts / top_k if experts and top_k else 0.0
