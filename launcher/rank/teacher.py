"""The objective of a rank (launcher.components.objective): cross-entropy, or distillation from a frozen, placed teacher.

The teacher is read from a run directory or a Hugging Face folder.

A run directory gives its spec.yaml (the teacher's architecture) and its newest complete checkpoint,
consolidated by the strategy that wrote it, as `train-export` reads it; a Hugging Face folder is
built as model.kind=hf with model.path. The teacher is built with torch's RNG forked, so the
student's init, dropout and data order are those of the same run without distillation. Its weights
are cast to the training dtype, it is in eval mode with requires_grad off everywhere, and it is
placed as the strategy places the student: a whole copy on the device (one process, DDP), or under
FSDP2 sharded per decoder layer over the same mesh, so that it fits where the student fits.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from launcher.components import checkpoint
from launcher.components.distill import Distiller
from launcher.components.model.build import build_model
from launcher.components.objective import CrossEntropy, Objective
from launcher.components.precision import train_dtype
from launcher.config.model import ModelConfig
from launcher.parallel.dims import DistContext
from launcher.parallel.registry import STRATEGIES, strategy_module
from launcher.spec import RunSpec, load_spec

SPEC = "spec.yaml"


def load_teacher(path: str) -> nn.Module:
    """The teacher's model on the CPU in float32, weights loaded: from a run directory or a HF folder."""
    folder = Path(path)
    if (folder / SPEC).is_file():
        spec = load_spec(folder / SPEC)
        step_dir = checkpoint.good_checkpoints(folder, warn=False)[0]
        model = build_model(spec.model)
        model.load_state_dict(strategy_module(spec.parallel.strategy).consolidate(step_dir))
        return model
    return build_model(ModelConfig(kind="hf", path=str(folder)))


def _place(teacher: nn.Module, spec: RunSpec, dist: DistContext, mesh: DeviceMesh | None) -> nn.Module:
    """On the device, or FSDP2-sharded like the student (gathered per layer in forward, resharded after)."""
    teacher = teacher.to(dist.device)
    if not STRATEGIES[spec.parallel.strategy].fsdp_teacher:
        return teacher
    from torch.distributed.fsdp import fully_shard

    from launcher.components.model.hf import decoder_layers
    from launcher.parallel.fsdp import data_mesh

    shard_mesh = data_mesh(mesh, dist.dims.dp_replicate)
    for layer in decoder_layers(teacher) or []:
        fully_shard(layer, mesh=shard_mesh, reshard_after_forward=True)
    fully_shard(teacher, mesh=shard_mesh, reshard_after_forward=True)
    return teacher


def build_objective(spec: RunSpec, dist: DistContext, mesh: DeviceMesh | None) -> Objective:
    """Cross-entropy, or with distill.teacher the frozen, placed teacher's distillation objective."""
    if spec.distill.teacher is None:
        return CrossEntropy()
    with torch.random.fork_rng(devices=[]):
        teacher = load_teacher(spec.distill.teacher)
    teacher = teacher.to(dtype=train_dtype(spec.precision)).eval().requires_grad_(False)
    return Distiller(_place(teacher, spec, dist, mesh), spec.distill)
