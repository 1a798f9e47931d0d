"""The objective seam: cross-entropy and distillation answer the same call, given outputs and the whole batch."""

from __future__ import annotations

import torch
from torch import nn

from launcher.components.distill import Distiller, kd_loss_sum
from launcher.components.model.loss import lm_loss
from launcher.components.objective import CrossEntropy, Objective
from launcher.config.distill import DistillConfig


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
