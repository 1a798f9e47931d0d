"""Every distillation spec the rules refuse before launch, with its key and fix; the chunked KL against a direct one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import write_spec
from launcher.components.objectives.distillation import kd_loss_sum
from launcher.front.cli import precheck


def _errors(*argv: str) -> dict[tuple[str, ...], str]:
    return {e.keys: e.message for e in precheck(list(argv))}


def test_settings_out_of_range_are_refused(hf_teacher: Path) -> None:
    errors = _errors(
        "distill=kd", f"distill.teacher={hf_teacher}", "model.vocab_size=300",
        "distill.kd_ratio=1.5", "distill.temperature=0", "distill.loss=js",
    )  # fmt: skip
    assert "[0, 1]" in errors[("distill.kd_ratio",)]
    assert "must be positive" in errors[("distill.temperature",)]
    assert "forward_kl, reverse_kl" in errors[("distill.loss",)]
    assert set(errors) == {("distill.kd_ratio",), ("distill.temperature",), ("distill.loss",)}


def test_teacher_paths_and_vocabularies_are_checked(hf_teacher: Path, tmp_path: Path) -> None:
    assert (
        "does not exist"
        in _errors("distill=kd", f"distill.teacher={tmp_path / 'nope'}")[("distill.teacher",)]
    )
    assert (
        "neither a run directory"
        in _errors("distill=kd", f"distill.teacher={tmp_path}")[("distill.teacher",)]
    )
    message = _errors("distill=kd", f"distill.teacher={hf_teacher}")[("distill.teacher", "model.vocab_size")]
    assert "300 ids and the student's 256" in message and "model.vocab_size=300" in message
    untrained = tmp_path / "untrained"
    write_spec(["train.max_steps=1"], untrained)
    assert (
        "no complete checkpoint"
        in _errors("distill=kd", f"distill.teacher={untrained}")[("distill.teacher",)]
    )


def test_pipeline_parallel_is_refused_with_the_reason(hf_teacher: Path) -> None:
    errors = _errors(
        "distill=kd",
        f"distill.teacher={hf_teacher}",
        "model.vocab_size=300",
        "parallel=pp",
        "launcher.nproc=2",
    )
    assert (
        "a pipeline's stages never hold the whole student's logits"
        in errors[("distill.teacher", "parallel.strategy")]
    )


def test_fsdp_with_tensor_parallel_is_refused_with_the_reason(hf_teacher: Path) -> None:
    """The student's logits are split over the vocabulary under tp_size > 1; the teacher's are whole."""
    errors = _errors(
        "distill=kd", f"distill.teacher={hf_teacher}", "model.vocab_size=300",
        "parallel=tp_fsdp", "launcher=local", "launcher.nproc=4",
    )  # fmt: skip
    message = errors[("distill.teacher", "parallel.tp_size")]
    assert "splits the student's projections and its logits" in message and "parallel.tp_size=1" in message


def test_distill_none_composes_without_a_teacher() -> None:
    assert _errors("distill=none") == {}
    # distill=kd: the teacher must be named
    assert ("distill.teacher",) in {e.keys for e in precheck(["distill=kd"])}


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl"])
def test_chunked_kl_equals_the_whole_one_and_its_gradient(loss: str) -> None:
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(3, 10, 50, generator=gen, requires_grad=True)
    teacher = torch.randn(3, 10, 50, generator=gen)
    labels = torch.randint(0, 50, (3, 10), generator=gen)
    labels[0, :4] = -100
    chunked = kd_loss_sum(student, teacher, labels, temperature=2.0, loss=loss, chunk_rows=7)
    (grad_chunked,) = torch.autograd.grad(chunked, student)
    log_s, log_t = F.log_softmax(student / 2.0, -1), F.log_softmax(teacher / 2.0, -1)
    pair = (log_t, log_s) if loss == "forward_kl" else (log_s, log_t)
    kl = (pair[0].exp() * (pair[0] - pair[1])).sum(-1)
    whole = 4.0 * (kl * (labels != -100)).sum()
    (grad_whole,) = torch.autograd.grad(whole, student)
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(grad_chunked, grad_whole)
