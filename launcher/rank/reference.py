"""The reference model of a preference objective (dpo, kto), placed like the distillation teacher.

- With LoRA/QLoRA adapters the reference is the policy itself with every adapter switched off for
  its forward (what peft's `disable_adapter` does; our adapters are injected, so the layers are
  switched directly): the frozen base is the initial policy, and no second copy exists.
- Without adapters it is a frozen copy of the initial policy: a Hugging Face model read again from
  model.path, or a copy of the freshly built model (before any checkpoint is loaded, so a resumed
  run compares with the same initial weights), cast to the training dtype, in eval mode with
  requires_grad off, and placed as the teacher is (a whole copy per process; FSDP2-sharded per
  decoder layer under fsdp).
- simpo and orpo need none; with objective.reference=precompute the reference reads every pair once
  before training (launcher.rank.reference_logps) and the batches carry the rows' `ref_logps`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from launcher.components.adapters import adapter_layers
from launcher.components.model.build import build_model
from launcher.components.model.loss import model_inputs
from launcher.components.precision import train_dtype
from launcher.components.preference import Preference
from launcher.config.objective import NEEDS_REFERENCE
from launcher.parallel.dims import DistContext
from launcher.rank.teacher import _place
from launcher.spec import RunSpec


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Run `model` as its base: every injected LoRA adapter disabled, then enabled again."""
    layers = list(adapter_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def frozen_copy(spec: RunSpec, model: nn.Module, dist: DistContext, mesh: DeviceMesh | None) -> nn.Module:
    """The initial policy as a frozen, placed module: read from model.path, or copied from `model`."""
    with torch.random.fork_rng(devices=[]):
        if (
            spec.model.kind == "hf" and spec.model.path
        ):  # as the policy was built: same vocabulary, same weights
            reference = build_model(spec.model)
        else:
            reference = copy.deepcopy(model)
    reference = reference.to(dtype=train_dtype(spec.precision)).eval().requires_grad_(False)
    return _place(reference, spec, dist, mesh)


def preference_objective(
    spec: RunSpec, dist: DistContext, mesh: DeviceMesh | None, model: nn.Module
) -> Preference:
    """The preference objective of spec.objective, with its frozen reference when it needs one."""
    cfg = spec.objective
    objective = Preference(cfg)
    if cfg.name not in NEEDS_REFERENCE or adapter_layers(model):
        return objective  # adapters: the policy is bound after wrapping (bind_policy)
    reference = frozen_copy(spec, model, dist, mesh)
    if (
        cfg.reference == "precompute"
    ):  # used once before training (launcher.rank.reference_logps), then dropped
        objective.reference_copy = reference
        return objective
    objective.reference = lambda batch: reference(**model_inputs(batch))
    return objective


def bind_policy(objective: object, policy: nn.Module) -> None:
    """Give an adapter run's preference objective its reference: the wrapped policy with adapters off."""
    if not isinstance(objective, Preference) or objective.reference is not None:
        return
    if objective.cfg.name not in NEEDS_REFERENCE or objective.cfg.reference == "precompute":
        return

    def reference(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with adapters_off(policy):
            return policy(**model_inputs(batch))

    objective.reference = reference
