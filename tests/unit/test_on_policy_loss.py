"""The on-policy distillation loss equals TRL's GKDTrainer.generalized_jsd_loss on the same logits."""

from __future__ import annotations

import pytest
import torch

from launcher.components.objectives.on_policy import jsd_loss_sum


def _logits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student and teacher logits [2, 7, 11] in float32 and labels with prompt and padding positions at -100."""
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(2, 7, 11, generator=generator) * 3
    teacher = torch.randn(2, 7, 11, generator=generator) * 3
    labels = torch.randint(0, 11, (2, 7), generator=generator)
    labels[0, :3] = -100  # a prompt
    labels[1, :2] = -100
    labels[1, 5:] = -100  # right padding
    return student, teacher, labels


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_generalized_jsd_matches_trl(beta: float, temperature: float) -> None:
    from trl.experimental.gkd import GKDTrainer

    student, teacher, labels = _logits()
    counted = int((labels != -100).sum())
    ours = jsd_loss_sum(student, teacher, labels, beta=beta, temperature=temperature, chunk_rows=5) / counted
    theirs = GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta=beta, temperature=temperature)
    assert float(ours) == pytest.approx(float(theirs), abs=1e-6)
    # and their gradients with respect to the student's logits (ours is recomputed chunk by chunk)
    mine, trl = student.clone().requires_grad_(), student.clone().requires_grad_()
    (
        jsd_loss_sum(mine, teacher, labels, beta=beta, temperature=temperature, chunk_rows=5) / counted
    ).backward()
    GKDTrainer.generalized_jsd_loss(trl, teacher, labels, beta=beta, temperature=temperature).backward()
    torch.testing.assert_close(mine.grad, trl.grad, atol=1e-6, rtol=0)


def test_beta_one_is_reverse_kl() -> None:
    student, teacher, labels = _logits()
    mask = labels != -100
    log_s, log_t = student.log_softmax(-1), teacher.log_softmax(-1)
    reverse = (log_s.exp() * (log_s - log_t)).sum(-1)[mask].sum()
    assert float(jsd_loss_sum(student, teacher, labels, beta=1.0)) == pytest.approx(float(reverse), rel=1e-6)
