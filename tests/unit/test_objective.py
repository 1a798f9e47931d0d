"""The objective seam: cross-entropy and distillation answer the same call, given outputs and the whole batch;
the registry names one module per objective option, each declaring its frozen model as data."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from torch import nn

import launcher
from launcher.components.model.loss import lm_loss
from launcher.components.objectives import (
    OBJECTIVES,
    SOURCES,
    WITH_TEACHER,
    FrozenModel,
    Objective,
    module_name,
    objective_module,
)
from launcher.components.objectives.cross_entropy import CrossEntropy
from launcher.components.objectives.distillation import Distiller, kd_loss_sum
from launcher.components.objectives.preference import Preference
from launcher.config.distill import DistillConfig
from launcher.config.objective import NAMES, ObjectiveConfig


class _Logits(nn.Module):
    """A frozen 'teacher': fixed logits per token id."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table(input_ids)


def _batch(vocab: int = 11) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (2, 6))
    labels = ids.roll(-1, 1)
    labels[0, :2] = -100  # a masked prompt
    return torch.randn(2, 6, vocab), {"input_ids": ids, "labels": labels}


def test_cross_entropy_is_the_summed_token_loss_and_its_count() -> None:
    logits, batch = _batch()
    objective: Objective = CrossEntropy()
    loss_sum, counted = objective.loss_sum(logits, batch)
    want_sum, want_count = lm_loss(logits, batch["labels"])
    assert torch.equal(loss_sum, want_sum) and int(counted) == int(want_count) == 10
    assert objective.metrics(lambda sums: sums) == {}


def test_distillation_mixes_the_teacher_term_in_training_and_reports_plain_ce_held_out() -> None:
    logits, batch = _batch()
    teacher = _Logits(11).requires_grad_(False)
    cfg = DistillConfig(teacher="unused", kd_ratio=0.25, temperature=2.0)
    objective: Objective = Distiller(teacher, cfg)
    ce_sum, counted = lm_loss(logits, batch["labels"])
    kd = kd_loss_sum(logits, teacher(batch["input_ids"]), batch["labels"], temperature=2.0, loss=cfg.loss)
    trained, n = objective.loss_sum(logits, batch)
    assert torch.allclose(trained, 0.75 * ce_sum + 0.25 * kd) and int(n) == int(counted)
    held_out, _ = objective.loss_sum(logits, batch, train=False)
    assert torch.equal(held_out, ce_sum)
    metrics = objective.metrics(lambda sums: sums)  # the training call only: held-out batches are not summed
    assert metrics["ce_loss"] == float(ce_sum) / 10 and abs(metrics["kd_loss"] - float(kd) / 10) < 1e-6


def test_the_registry_names_one_module_for_each_objective_option() -> None:
    options = {
        path.stem for path in (Path(launcher.__file__).parent.parent / "conf" / "objective").glob("*.yaml")
    }
    assert set(OBJECTIVES) == set(NAMES) == options
    for name in sorted({*OBJECTIVES.values(), WITH_TEACHER}):
        module = importlib.import_module(f"launcher.components.objectives.{name}")
        assert callable(module.frozen_model) and callable(module.build), name


@pytest.mark.parametrize(
    ("name", "teacher", "adapters", "reference", "declared", "built"),
    [
        ("sft", None, False, "model", None, CrossEntropy),
        ("sft", "runs/t", False, "model", FrozenModel(source="teacher", path="runs/t"), Distiller),
        ("dpo", None, False, "model", FrozenModel(source="copy"), Preference),
        ("dpo", None, True, "model", FrozenModel(source="adapters_off"), Preference),
        ("dpo", None, False, "precompute", FrozenModel(source="copy", precomputed=True), Preference),
        ("kto", None, True, "model", FrozenModel(source="adapters_off"), Preference),
        ("simpo", None, False, "model", None, Preference),
        ("orpo", None, True, "model", None, Preference),
    ],
)
def test_each_objective_declares_its_frozen_model_as_data(
    name, teacher, adapters, reference, declared, built
) -> None:
    objective_cfg, distill = ObjectiveConfig(name=name, reference=reference), DistillConfig(teacher=teacher)
    module = objective_module(objective_cfg, distill)
    assert module.__name__.endswith("." + module_name(objective_cfg, distill))
    assert module.frozen_model(objective_cfg, distill, adapters=adapters) == declared
    assert declared is None or declared.source in SOURCES
    frozen = None if declared is None else _Logits(11).requires_grad_(False)
    assert type(module.build(objective_cfg, distill, frozen)) is built


def test_a_built_preference_objective_reads_its_placed_reference_as_the_policy_is_called() -> None:
    """build() hands the reference the model's inputs of the batch; the loss is that of the reference's logits."""
    torch.manual_seed(0)
    reference, cfg = _Logits(11).requires_grad_(False), ObjectiveConfig(name="dpo")
    ids = torch.randint(0, 11, (4, 6))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    policy_logits = torch.randn(4, 6, 11)
    built = objective_module(cfg, DistillConfig()).build(cfg, DistillConfig(), reference)
    direct = Preference(cfg, reference=lambda b: reference(b["input_ids"]))
    assert torch.equal(built.loss_sum(policy_logits, batch)[0], direct.loss_sum(policy_logits, batch)[0])
