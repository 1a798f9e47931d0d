"""distill=on_policy: on-policy distillation (GKD, Agarwal et al. 2024): the generalised JSD between the
student and a frozen teacher over the tokens the student sampled itself.

The batches come from launcher.rank.on_policy_source: each row is a prompt and a completion, the
completion the student's own sample (or, on the 1 - distill.lmbda share of steps, the data's own
continuation), its tokens the only labels. The teacher, declared here and placed as offline
distillation places it (launcher.rank.objective), reads the same rows under no_grad and scores every
completion token. The loss of a micro batch is the generalised JSD summed over those tokens, exactly
TRL's `GKDTrainer.generalized_jsd_loss` (beta 0: KL(teacher || student), 1: KL(student || teacher),
between: beta KL(teacher || M) + (1 - beta) KL(student || M) with M = beta teacher + (1 - beta)
student; both models' logits divided by distill.temperature), so the loop's division by the step's
completion tokens gives TRL's per-token mean. As in offline distillation, it is computed over chunks
of rows, each upcast to float32 and recomputed in backward, so no float32 copy of the whole
vocabulary is kept.

Its metrics: `kl` (KL(student || teacher) per completion token at temperature 1, the quantity
on-policy distillation drives down), `completion_len` (mean sampled tokens), `completion_clipped`
(share of completions cut at max_new_tokens) and `on_policy` (share of rows the student sampled).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from launcher.components.objectives import DataSum, Frozen, FrozenModel, trained_tokens
from launcher.config.distill import KD_CHUNK_ROWS, DistillConfig
from launcher.config.objective import ObjectiveConfig

if TYPE_CHECKING:  # torch only on a rank
    import torch

    from launcher.components.model.loss import HeadOutputs

CLIPPED = "completion_clipped"
"""Batch key: 1.0 for a row whose completion reached max_new_tokens (no stop token), per row."""
SAMPLED = "on_policy"
"""Batch key: 1.0 for a row whose completion the student sampled, 0.0 for the data's own, per row."""


def _chunk_jsd(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, temperature: float, beta: float,
    head: Callable | None = None,
):  # fmt: skip
    """Summed generalised JSD of the masked rows of one chunk of (rows, vocab) logits, in float32 (TRL's formula)."""
    import torch
    import torch.nn.functional as F

    if head is not None:
        student = head(student)
    log_s = F.log_softmax(student.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher.float() / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(log_s, log_t, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(log_t, log_s, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=log_s.dtype, device=log_s.device)
        log_m = torch.logsumexp(torch.stack([log_s + torch.log1p(-b), log_t + torch.log(b)]), dim=0)
        kl_teacher = F.kl_div(log_m, log_t, reduction="none", log_target=True)
        kl_student = F.kl_div(log_m, log_s, reduction="none", log_target=True)
        jsd = b * kl_teacher + (1 - b) * kl_student
    return (jsd.sum(-1) * mask).sum()


def _rows(student: torch.Tensor | HeadOutputs, teacher: torch.Tensor, mask: torch.Tensor, chunk_rows: int):
    """(student rows or hidden rows, teacher rows, mask rows, head or None) per chunk of the flattened tokens."""
    from launcher.components.model.loss import HeadOutputs, head_chunks

    if isinstance(student, HeadOutputs):
        for rows, teacher_rows, mask_rows in head_chunks(student, teacher, mask):
            yield rows, teacher_rows, mask_rows, student.head
        return
    vocab = student.shape[-1]
    flat_s, flat_t, flat_m = student.reshape(-1, vocab), teacher.reshape(-1, vocab), mask.reshape(-1)
    for start in range(0, flat_s.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        yield flat_s[rows], flat_t[rows], flat_m[rows], None


def jsd_loss_sum(
    student_logits: torch.Tensor | HeadOutputs,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    chunk_rows: int = KD_CHUNK_ROWS,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The generalised JSD summed over the positions whose label is kept (labels != ignore_index), chunk by chunk.

    Divided by the kept positions, it is TRL's `generalized_jsd_loss(..., labels, beta, temperature)`.
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta}")
    mask = (labels != ignore_index).float()
    total = torch.zeros((), dtype=torch.float32, device=labels.device)
    for rows, teacher_rows, mask_rows, head in _rows(
        student_logits, teacher_logits.detach(), mask, chunk_rows
    ):
        total = total + checkpoint(
            _chunk_jsd, rows, teacher_rows, mask_rows, temperature, beta, head,
            use_reentrant=False, preserve_rng_state=False,
        )  # fmt: skip
    return total


def _row_sum(batch: dict[str, torch.Tensor], key: str, labels: torch.Tensor) -> torch.Tensor:
    """The rows flagged `key` (0 for a batch without the flag: the micro-batch search's made-up batches)."""
    import torch

    flags = batch.get(key)
    return torch.zeros((), device=labels.device) if flags is None else flags.float().sum()


class OnPolicyDistiller:
    """The on-policy distillation objective over the placed teacher (the Objective protocol).

    Keeps the interval's sums (loss, KL, completion tokens, rows, clipped and sampled rows) for `metrics`.
    """

    counts_processed_tokens = True  # student and teacher run over every position, prompts included

    def __init__(self, teacher: Frozen, cfg: DistillConfig) -> None:
        self.teacher, self.cfg = teacher, cfg
        self._sums: list[torch.Tensor] | None = None

    def teacher_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The teacher's logits over `batch`'s rows (no_grad): the score of every token the student wrote."""
        import torch

        from launcher.components.model.loss import model_inputs

        with torch.no_grad():
            return self.teacher(**model_inputs(batch))

    def kl_sum(self, student_logits: torch.Tensor | HeadOutputs, teacher_logits: torch.Tensor,
               labels: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """KL(student || teacher) at temperature 1 summed over the completion tokens, detached (the `kl` metric)."""
        import torch

        if isinstance(student_logits, torch.Tensor):
            student_logits = student_logits.detach()
        with torch.no_grad():
            return jsd_loss_sum(student_logits, teacher_logits, labels, beta=1.0, temperature=1.0)

    def loss_sum(
        self, outputs: torch.Tensor, batch: dict[str, torch.Tensor], *, train: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the JSD summed over the completion tokens, their number); held-out sequences: the plain cross-entropy."""
        import torch

        from launcher.components.model.loss import lm_loss

        labels = batch["labels"]
        if not train:
            return lm_loss(outputs, labels)
        teacher_logits = self.teacher_logits(batch)
        cfg = self.cfg
        loss = jsd_loss_sum(outputs, teacher_logits, labels, beta=cfg.beta, temperature=cfg.temperature)
        same = cfg.beta == 1.0 and cfg.temperature == 1.0
        kl = loss.detach() if same else self.kl_sum(outputs, teacher_logits, labels)
        del teacher_logits
        counted = (labels != -100).sum()
        rows = float(labels.shape[0])
        sums = [
            loss.detach(), kl, counted.float(), torch.tensor(rows, device=labels.device),
            _row_sum(batch, CLIPPED, labels), _row_sum(batch, SAMPLED, labels),
        ]  # fmt: skip
        self._sums = sums if self._sums is None else [a + b for a, b in zip(self._sums, sums, strict=True)]
        return loss, counted

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Completion tokens (labels != -100): the loss is their mean over the step."""
        return trained_tokens(batch)

    def metrics(self, data_sum: DataSum) -> dict[str, float]:
        """kl, completion_len, completion_clipped and on_policy since the last call, summed over data-parallel ranks."""
        sums, self._sums = self._sums, None
        values = [0.0] * 6 if sums is None else [float(x) for x in sums]
        _, kl, tokens, rows, clipped, sampled = data_sum(values)
        per_row = max(rows, 1.0)
        return {
            "kl": kl / max(tokens, 1.0),
            "completion_len": tokens / per_row,
            CLIPPED: clipped / per_row,
            SAMPLED: sampled / per_row,
        }


def frozen_model(objective: ObjectiveConfig, distill: DistillConfig, *, adapters: bool) -> FrozenModel | None:
    """The teacher: a run directory or Hugging Face folder, read and placed like the student (as offline)."""
    return FrozenModel(source="teacher", path=distill.teacher)


def build(objective: ObjectiveConfig, distill: DistillConfig, frozen: Frozen | None) -> OnPolicyDistiller:
    """The on-policy distillation objective over the placed teacher."""
    if frozen is None:
        raise ValueError(
            "on-policy distillation needs its teacher placed (launcher.rank.objective places it)"
        )
    return OnPolicyDistiller(frozen, distill)
