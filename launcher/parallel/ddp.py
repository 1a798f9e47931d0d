"""The DDP wrap of a model part: every data-parallel rank holds it whole; DistributedDataParallel averages gradients.

Gradients are all-reduced in buckets (parallel.bucket_mb) while backward still runs, skipped
inside `no_sync` (accumulation micro batches), and optionally compressed by a communication hook
(fp16 or bf16 casts, or PowerSGD low-rank approximation with error feedback). Under a pipeline each
stage is wrapped over its data-parallel group, and torch's PipelineStage defers the all-reduce to the
last pipeline micro batch. PowerSGD keeps per-rank state (error feedback, warm-started factors, its
RNG), which launcher.parallel.parts saves per rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from launcher.config.parallel import ParallelConfig
from launcher.parallel import ddp_fake_group

_POWERSGD_FIELDS = ("error_dict", "p_memory_dict", "q_memory_dict", "iter")


def apply_ddp(
    part: nn.Module, device: torch.device, parallel: ParallelConfig, group: dist.ProcessGroup | None
) -> DistributedDataParallel:
    """DistributedDataParallel over `group` (None: every rank) with the spec's bucket settings.

    On torch's fake process group (dry_run=simulate) the start's shape check and broadcast are skipped
    and the reducer is met where it reads what a real group delivers (launcher.parallel.ddp_fake_group).
    """
    simulated = ddp_fake_group.simulated(group)
    model = DistributedDataParallel(
        part,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
        bucket_cap_mb=parallel.bucket_mb,
        static_graph=parallel.static_graph,
        gradient_as_bucket_view=parallel.gradient_as_bucket_view,
        find_unused_parameters=parallel.find_unused_parameters,
        init_sync=not simulated,
    )
    if simulated:
        ddp_fake_group.prepare(model)
    return model


def register_comm_hook(
    model: DistributedDataParallel, parallel: ParallelConfig
) -> powerSGD_hook.PowerSGDState | None:
    """Install the gradient communication hook; returns PowerSGD's state (it is checkpointed)."""
    name = parallel.comm_hook
    if name == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=model.process_group,
            matrix_approximation_rank=parallel.powersgd_rank,
            start_powerSGD_iter=parallel.powersgd_start_iter,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    return None


def powersgd_state(state: powerSGD_hook.PowerSGDState) -> dict[str, Any]:
    """PowerSGD's internal state in weights_only-loadable types (its RNG as tensors and ints)."""
    kind, key, pos, has_gauss, cached = state.rng.get_state()
    return {
        **{name: getattr(state, name) for name in _POWERSGD_FIELDS},
        "rng": [kind, torch.from_numpy(key.copy()), pos, has_gauss, cached],
    }


def set_powersgd_state(state: powerSGD_hook.PowerSGDState, saved: dict[str, Any]) -> None:
    """Restore what `powersgd_state` captured."""
    for name in _POWERSGD_FIELDS:
        setattr(state, name, saved[name])
    kind, key, pos, has_gauss, cached = saved["rng"]
    state.rng.set_state((kind, key.numpy(), pos, has_gauss, cached))
