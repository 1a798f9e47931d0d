"""objective=sft with distill.teacher: knowledge distillation from a frozen teacher, and the chunked KL term.

With `distill.teacher` set, each micro batch's loss is (1 - kd_ratio) * CE + kd_ratio * KD, both summed
over the trained tokens (labels != -100), so the loop's division by the step's trained tokens keeps
the normalization token-exact. KD is the temperature-softened KL divergence between the teacher's and
the student's next-token distributions, times temperature squared (Hinton et al. 2015, so that its
gradient keeps its scale as the temperature changes): forward_kl is KL(teacher || student), the classic
mode-covering form; reverse_kl is KL(student || teacher), mode-seeking (MiniLLM, Gu et al. 2024).

The KL is computed over chunks of KD_CHUNK_ROWS token positions: only one chunk of each model's logits
is upcast to float32 at a time, and each chunk is recomputed in backward (activation checkpointing) so
autograd keeps no float32 copy of the whole vocabulary either. The teacher, declared by `frozen_model`
and read and placed by launcher.rank.objective, is frozen, in eval mode, and runs under torch.no_grad;
it is never saved in checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from launcher.components.objectives import Frozen, FrozenModel, trained_tokens
from launcher.config.distill import KD_CHUNK_ROWS, DistillConfig
from launcher.config.objective import ObjectiveConfig

if TYPE_CHECKING:  # torch only on a rank: the launching process never needs it
    import torch

    from launcher.components.model.loss import HeadOutputs


def _chunk_kl(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, temperature: float, reverse: bool,
    head: Callable | None = None,
):  # fmt: skip
    """Summed KL of the masked rows of one chunk of (rows, vocab) logits (or hidden rows and their head), in float32."""
    import torch.nn.functional as F

    if head is not None:
        student = head(student)
    log_s = F.log_softmax(student.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher.float() / temperature, dim=-1)
    kl = (log_s.exp() * (log_s - log_t)) if reverse else (log_t.exp() * (log_t - log_s))
    return (kl.sum(-1) * mask).sum()


def kd_loss_sum(
    student_logits: torch.Tensor | HeadOutputs,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float,
    loss: str,
    chunk_rows: int = KD_CHUNK_ROWS,
    ignore_index: int = -100,
) -> torch.Tensor:
    """temperature^2 x the KL summed over the trained positions (labels != ignore_index), chunk by chunk.

    A chunked student (HeadOutputs) is projected inside each recomputed chunk: its chunks, not KD_CHUNK_ROWS.
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    from launcher.components.model.loss import HeadOutputs, head_chunks

    if isinstance(student_logits, HeadOutputs):
        mask = (labels != ignore_index).float()
        total = torch.zeros((), dtype=torch.float32, device=labels.device)
        for rows, teacher_rows, mask_rows in head_chunks(student_logits, teacher_logits.detach(), mask):
            total = total + checkpoint(
                _chunk_kl, rows, teacher_rows, mask_rows, temperature, loss == "reverse_kl", student_logits.head,
                use_reentrant=False, preserve_rng_state=False,
            )  # fmt: skip
        return total * temperature**2
    vocab = student_logits.shape[-1]
    student, teacher = student_logits.reshape(-1, vocab), teacher_logits.reshape(-1, vocab).detach()
    mask = (labels.reshape(-1) != ignore_index).float()
    total = torch.zeros((), dtype=torch.float32, device=student.device)
    for start in range(0, student.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        total = total + checkpoint(
            _chunk_kl, student[rows], teacher[rows], mask[rows], temperature, loss == "reverse_kl",
            use_reentrant=False, preserve_rng_state=False,
        )  # fmt: skip
    return total * temperature**2


class Distiller:
    """The distillation objective: cross-entropy mixed with the frozen teacher's KD term (the Objective protocol).

    Keeps the interval's CE, KD and token sums for `metrics`.
    """

    counts_processed_tokens = True  # student and teacher compute every token, prompts included

    def __init__(self, teacher: Frozen, cfg: DistillConfig) -> None:
        self.teacher, self.cfg = teacher, cfg
        self._sums: list[torch.Tensor] | None = None

    def loss_sum(
        self, outputs: torch.Tensor, batch: dict[str, torch.Tensor], *, train: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """((1 - kd_ratio) * CE sum + kd_ratio * KD sum, trained tokens) of one micro batch (under the run's autocast).

        Held-out batches (`train` False) report the plain cross-entropy, the loss every run compares.
        """
        import torch

        from launcher.components.model.loss import lm_loss, model_inputs

        labels = batch["labels"]
        ce_sum, counted = lm_loss(outputs, labels)
        if not train:
            return ce_sum, counted
        with torch.no_grad():
            teacher_logits = self.teacher(**model_inputs(batch))
        kd_sum = kd_loss_sum(
            outputs, teacher_logits, labels, temperature=self.cfg.temperature, loss=self.cfg.loss
        )
        del teacher_logits
        sums = [ce_sum.detach().float(), kd_sum.detach(), counted.float()]
        self._sums = sums if self._sums is None else [a + b for a, b in zip(self._sums, sums, strict=True)]
        ratio = self.cfg.kd_ratio
        return (1.0 - ratio) * ce_sum + ratio * kd_sum, counted

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Trained tokens (labels != -100): both terms are sums over them."""
        return trained_tokens(batch)

    def metrics(self, data_sum: Callable[[list[float]], list[float]]) -> dict[str, float]:
        """ce_loss and kd_loss per trained token since the last call, summed over data-parallel ranks by `data_sum`.

        The two terms of the record's `loss` before weighting; reading them is a log step's device sync.
        """
        sums, self._sums = self._sums, None
        ce_sum, kd_sum, tokens = data_sum([0.0, 0.0, 0.0] if sums is None else [float(x) for x in sums])
        return {"ce_loss": ce_sum / max(tokens, 1.0), "kd_loss": kd_sum / max(tokens, 1.0)}


def frozen_model(objective: ObjectiveConfig, distill: DistillConfig, *, adapters: bool) -> FrozenModel | None:
    """The teacher: a run directory or Hugging Face folder, read and placed like the student."""
    return FrozenModel(source="teacher", path=distill.teacher)


def build(objective: ObjectiveConfig, distill: DistillConfig, frozen: Frozen | None) -> Distiller:
    """The distillation objective over the placed teacher."""
    if frozen is None:
        raise ValueError("distillation needs its teacher placed (launcher.rank.objective places it)")
    return Distiller(frozen, distill)
