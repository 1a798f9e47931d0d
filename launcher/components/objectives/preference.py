"""The preference objectives (dpo, simpo, orpo, kto) behind the Objective seam, and their metrics.

A paired batch (data.format=preference) holds 2B rows, the B chosen responses then their B rejected
ones, each row prompt + response with the prompt's labels -100; a kto batch holds B examples, then B
KL rows, and `kto_label` (1 desirable, 0 undesirable). A row's log-prob is the sum of its response tokens'
log-probs (labels != -100); simpo and orpo use its mean over the response. Each objective returns
the SUM of its per-pair (per-example, for kto) losses and the number of pairs, and `count` tells
the loop that same number, so the step's loss is the mean over its pairs however micro batches and
ranks share them. The formulas follow TRL (tests/unit/test_preference_trl.py checks them):

- dpo: -log sigmoid(beta * ((pc - rc) - (pr - rr))), with conservative label smoothing; ipo:
  ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 beta))^2 (p: policy, r: reference, n: response tokens);
- simpo: -log sigmoid(beta * (mean_c - mean_r) - gamma) (mean: length-normalised log-prob), no reference;
- orpo: -mean_c - beta * log sigmoid(log odds(mean_c) - log odds(mean_r)), no reference;
- kto: w_d (1 - sigmoid(beta (p - r - z0))) per desirable example, w_u (1 - sigmoid(beta (z0 - (p - r))))
  per undesirable one, z0 KTO's KL estimate: the mean log-ratio of the batch's KL rows (each prompt with
  the previous example's completion, as TRL builds them), clamped at 0 and detached.

The reference (dpo, kto) is declared by `frozen_model`: with LoRA adapters the policy itself with
its adapters switched off, without them a frozen copy of the initial policy (launcher.rank.objective
places it like the distillation teacher); with objective.reference=precompute it reads every pair
once before training and the batches carry the rows' `ref_logps`. The objective calls it as a
callable batch -> logits under no_grad. Held-out batches (`train` False) report the responses'
cross-entropy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from launcher.components.objectives import Frozen, FrozenModel
from launcher.config.distill import DistillConfig
from launcher.config.objective import NEEDS_REFERENCE, ObjectiveConfig

if TYPE_CHECKING:  # torch only on a rank
    import torch

    from launcher.components.model.loss import HeadOutputs

Reference = Callable[[dict[str, "torch.Tensor"]], "torch.Tensor"]
"""The reference model's logits of a batch (called under torch.no_grad)."""
METRIC_KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracy",
    "logps/chosen",
    "logps/rejected",
)
"""What a preference objective adds to each log step's record."""


def logits_of(outputs: torch.Tensor | HeadOutputs) -> torch.Tensor:
    """The model's logits, projecting a chunked head's hidden states when the model returned them."""
    import torch

    return outputs if isinstance(outputs, torch.Tensor) else outputs.head(outputs.hidden)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed float32 log-prob of each row's trained tokens, their number) for (rows, T, vocab) logits."""
    import torch

    mask = labels != -100
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    picked = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1), mask.sum(-1)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends."""
    import torch

    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def paired_losses(
    cfg: ObjectiveConfig, logps: torch.Tensor, counts: torch.Tensor, ref_logps: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses, chosen rewards, rejected rewards, chosen logps, rejected logps) of a [chosen; rejected] batch."""
    import torch.nn.functional as F

    beta, smooth = cfg.beta, cfg.label_smoothing
    pc, pr = logps.chunk(2)
    nc, nr = counts.float().clamp(min=1).chunk(2)
    if cfg.name == "dpo":
        rc, rr = ref_logps.chunk(2)
        if cfg.loss == "ipo":
            delta = (pc - rc) / nc - (pr - rr) / nr
            losses = (delta - 1 / (2 * beta)) ** 2
        else:
            delta = (pc - rc) - (pr - rr)
            losses = -F.logsigmoid(beta * delta) * (1 - smooth) - F.logsigmoid(-beta * delta) * smooth
        return losses, beta * (pc - rc).detach(), beta * (pr - rr).detach(), pc.detach(), pr.detach()
    mean_c, mean_r = pc / nc, pr / nr
    if cfg.name == "simpo":
        margin = mean_c - mean_r - cfg.gamma / beta
        losses = -F.logsigmoid(beta * margin) * (1 - smooth) - F.logsigmoid(-beta * margin) * smooth
    else:  # orpo: the chosen response's mean NLL plus the odds-ratio term
        log_odds = (mean_c - mean_r) - (log1mexp(mean_c) - log1mexp(mean_r))
        losses = -mean_c - beta * F.logsigmoid(log_odds)
    return losses, beta * mean_c.detach(), beta * mean_r.detach(), mean_c.detach(), mean_r.detach()


def kto_losses(
    cfg: ObjectiveConfig, logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-example weighted KTO losses, rewards beta * log-ratio) of a kto batch's [examples; KL rows] log-probs."""
    import torch

    examples = len(desirable)
    ratio = logps[:examples] - ref_logps[:examples]
    z0 = (logps[examples:] - ref_logps[examples:]).detach().mean().clamp(min=0)
    want = desirable.bool()
    losses = torch.where(
        want,
        cfg.desirable_weight * (1 - torch.sigmoid(cfg.beta * (ratio - z0))),
        cfg.undesirable_weight * (1 - torch.sigmoid(cfg.beta * (z0 - ratio))),
    )
    return losses, cfg.beta * ratio.detach()


class Preference:
    """A preference objective (the Objective protocol): the loss of pairs (or kto rows) and their reward metrics."""

    counts_processed_tokens = True  # only responses are trained, but every row of both sides is computed

    def __init__(self, cfg: ObjectiveConfig, reference: Reference | None = None) -> None:
        self.cfg, self.reference = cfg, reference
        self._sums: torch.Tensor | None = None

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """The terms a batch adds to its step's mean: its pairs (kto: its examples, half its rows)."""
        return int(batch["input_ids"].shape[0]) // 2

    def _reference_logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch

        if "ref_logps" in batch:
            return batch["ref_logps"].float()
        with torch.no_grad():
            return sequence_logps(logits_of(self.reference(batch)), batch["labels"])[0]

    def loss_sum(
        self, outputs: torch.Tensor | HeadOutputs, batch: dict[str, torch.Tensor], *, train: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed per-pair loss, pairs) of a micro batch; held out: (the responses' summed cross-entropy, tokens)."""
        import torch

        from launcher.components.model.loss import lm_loss

        if not train:
            return lm_loss(outputs, batch["labels"])
        logps, counts = sequence_logps(logits_of(outputs), batch["labels"])
        ref = self._reference_logps(batch) if self.cfg.name in ("dpo", "kto") else None
        if self.cfg.name == "kto":
            want = batch["kto_label"].bool()
            losses, rewards = kto_losses(self.cfg, logps, ref, want)
            logps = logps[: len(want)]
            zero = torch.zeros((), device=logps.device)
            sums = [
                torch.where(want, rewards, zero).sum(), want.sum(), torch.where(want, zero, rewards).sum(),
                (~want).sum(), zero, zero, torch.where(want, logps.detach(), zero).sum(),
                torch.where(want, zero, logps.detach()).sum(),
            ]  # fmt: skip
        else:
            losses, chosen, rejected, logp_c, logp_r = paired_losses(self.cfg, logps, counts, ref)
            pairs = torch.tensor(float(len(losses)), device=logps.device)
            sums = [
                chosen.sum(), pairs, rejected.sum(), pairs, (chosen > rejected).float().sum(), pairs,
                logp_c.sum(), logp_r.sum(),
            ]  # fmt: skip
        total = torch.stack([s.float() for s in sums])
        self._sums = total if self._sums is None else self._sums + total
        return losses.sum(), torch.tensor(float(len(losses)), device=logps.device)

    def metrics(self, data_sum: Callable[[list[float]], list[float]]) -> dict[str, float]:
        """rewards/* and logps/* means since the last call, summed over data-parallel ranks by `data_sum`."""
        sums, self._sums = self._sums, None
        values = [0.0] * 8 if sums is None else [float(x) for x in sums.tolist()]
        rc, nc, rr, nr, correct, pairs, lc, lr = data_sum(values)
        chosen, rejected = rc / max(nc, 1.0), rr / max(nr, 1.0)
        record = {
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/margins": chosen - rejected,
            "logps/chosen": lc / max(nc, 1.0),
            "logps/rejected": lr / max(nr, 1.0),
        }
        if self.cfg.name != "kto":
            record["rewards/accuracy"] = correct / max(pairs, 1.0)
        return record


def frozen_model(objective: ObjectiveConfig, distill: DistillConfig, *, adapters: bool) -> FrozenModel | None:
    """dpo and kto: the reference, the policy's base with adapters off (LoRA) or else a frozen copy; simpo, orpo: none."""
    if objective.name not in NEEDS_REFERENCE:
        return None
    return FrozenModel(
        source="adapters_off" if adapters else "copy", precomputed=objective.reference == "precompute"
    )


def build(objective: ObjectiveConfig, distill: DistillConfig, frozen: Frozen | None) -> Preference:
    """The preference objective, reading its placed reference each step (None: none, or precomputed log-probs)."""
    if frozen is None:
        return Preference(objective)

    def reference(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from launcher.components.model.loss import model_inputs

        return frozen(**model_inputs(batch))

    return Preference(objective, reference)
