"""Online RL objectives (grpo, rloo) behind the Objective seam: the clipped surrogate over sampled completions.

A rollout batch (launcher.rank.rollouts) holds prompt + completion rows: `input_ids`, `labels` (the
completion's tokens, -100 on the prompt and padding: the completion mask), `advantages` [rows] and,
when the policy is updated several times per rollout batch (objective.num_iterations > 1), the sampling
policy's per-token log-probs `old_logps` [rows, T]; without them the ratio is taken against the
detached log-probs themselves (1, as TRL does). `keep` [rows] is 0 on the rows of a dropped group.
Token log-probs are those of logits / objective.temperature, as TRL's GRPOTrainer computes them.

The formulas and names follow TRL 1.16 (tests/unit/test_policy_gradient_trl.py drives TRL's own loss code
on the same rollouts):

- grpo: per token -min(r A, clip(r, 1 - eps, 1 + eps_high) A) + beta r KL, KL = exp(ref - logp) - (ref - logp) - 1
  (the reference's log-probs, a forward of the frozen model; r weighs it as TRL's default use_bias_correction_kl
  does, the unbiased reverse-KL gradient); summed as objective.loss_type says:
  grpo, each row's token mean (count: rows); bnpo, the micro batch's token mean (count: 1 per micro batch);
  dr_grpo, tokens / max_completion_length (count: rows x max_completion_length); dapo, tokens over the
  whole step's completion tokens (count: tokens). The loop divides the step's summed loss by its count
  over micro batches and ranks, so each is TRL's aggregation of the same global batch.
- rloo: per row -min(r A, clip(r) A) with r the ratio of the summed completion log-probs (count: rows);
  its KL (beta) enters the reward at rollout time (`sequence_kl`, the first-order log-ratio summed).

Advantages are the rollout source's (`advantages`, here): group-centred rewards, divided by the group's
std under objective.scale_rewards=group (TRL's grpo), or the leave-one-out baseline (rloo).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from launcher.components.objectives import Frozen, FrozenModel
from launcher.config.distill import DistillConfig
from launcher.config.objective import ObjectiveConfig

if TYPE_CHECKING:  # torch only on a rank
    import torch

    from launcher.components.model.loss import HeadOutputs

STD_EPS = 1e-4
"""Added to the group's std before dividing (TRL's constant)."""
METRIC_SLOTS = ("clip_low", "clip_high", "clip_region", "entropy", "kl", "tokens")
"""Token sums the objective keeps between log steps (clipped shares, entropy, KL) and the tokens they are over."""


def token_logps(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token float32 log-probs of the labels, per-token entropies, the completion mask) of [rows, T, vocab] logits."""
    import torch

    mask = labels != -100
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return picked * mask, entropy, mask


def group_advantages(rewards: torch.Tensor, cfg: ObjectiveConfig) -> torch.Tensor:
    """Advantages of [groups, num_generations] rewards: grpo's group-centred (and std-scaled) rewards, rloo's
    leave-one-out baseline (standardised over all rows with objective.normalize_advantages)."""
    n = rewards.shape[1]
    if cfg.name == "rloo":
        advantages = rewards - (rewards.sum(1, keepdim=True) - rewards) / (n - 1)
        if cfg.normalize_advantages:
            advantages = (advantages - advantages.mean()) / (advantages.std() + STD_EPS)
        return advantages
    advantages = rewards - rewards.mean(1, keepdim=True)
    if cfg.scale_rewards == "group":
        advantages = advantages / (rewards.std(1, keepdim=True) + STD_EPS)
    return advantages


def sequence_kl(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """rloo's per-row KL penalty: the first-order log-ratio of the sampling policy to the reference, summed over tokens."""
    return ((logps - ref_logps) * mask).sum(-1)


class PolicyGradient:
    """grpo or rloo (the Objective protocol): the clipped surrogate of a rollout batch, and its metrics."""

    counts_processed_tokens = False  # tokens_per_s counts the completions trained

    def __init__(self, cfg: ObjectiveConfig, reference: Frozen | None = None) -> None:
        self.cfg, self.reference = cfg, reference
        self.epsilon_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
        self._sums: torch.Tensor | None = None

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """The terms `batch` adds to its step's mean, as objective.loss_type aggregates (see the module docstring)."""
        keep = batch["keep"].bool()
        rows = int(keep.sum())
        if self.cfg.name == "rloo" or self.cfg.loss_type == "grpo":
            return rows
        if self.cfg.loss_type == "bnpo":
            return 1
        if self.cfg.loss_type == "dr_grpo":
            return rows * self.cfg.max_completion_length
        return int(((batch["labels"] != -100) & keep[:, None]).sum())  # dapo

    def reference_logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reference's per-token log-probs of the batch's labels (masked), under no_grad."""
        import torch

        from launcher.components.model.loss import model_inputs
        from launcher.components.objectives.preference import logits_of

        with torch.no_grad():
            logits = logits_of(self.reference(**model_inputs(batch)))
            return token_logps(logits, batch["labels"], self.cfg.temperature)[0]

    def per_token_loss(
        self, logps: torch.Tensor, batch: dict[str, torch.Tensor], mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(grpo's per-token loss, the ratio, the per-token KL or None) of a batch's log-probs."""
        import torch

        old = batch.get("old_logps")
        old = logps.detach() if old is None else old.float()
        ratio = torch.exp(logps - old)
        advantages = batch["advantages"].float()[:, None]
        clipped = torch.clamp(ratio, 1 - self.cfg.epsilon, 1 + self.epsilon_high)
        loss = -torch.min(ratio * advantages, clipped * advantages)
        kl = None
        if self.cfg.beta != 0.0:
            ref = self.reference_logps(batch) if "ref_logps" not in batch else batch["ref_logps"].float()
            kl = (
                torch.exp(ref - logps) - (ref - logps) - 1
            ) * ratio  # TRL's use_bias_correction_kl (its default)
            loss = loss + self.cfg.beta * kl
        return loss * mask, ratio, kl

    def _grpo(
        self, logps: torch.Tensor, batch: dict[str, torch.Tensor], mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(summed loss as loss_type aggregates, ratio, kl) of a grpo batch."""
        per_token, ratio, kl = self.per_token_loss(logps, batch, mask)
        kind = self.cfg.loss_type
        if kind == "grpo":
            return (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).sum(), ratio, kl
        if kind == "bnpo":
            return per_token.sum() / mask.sum().clamp(min=1), ratio, kl
        return (
            per_token.sum(),
            ratio,
            kl,
        )  # dr_grpo, dapo: the loop divides by rows x max length, or the tokens

    def loss_sum(
        self, outputs: torch.Tensor | HeadOutputs, batch: dict[str, torch.Tensor], *, train: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss as objective.loss_type aggregates, its count) of a rollout micro batch."""
        import torch

        from launcher.components.objectives.preference import logits_of

        logps, entropy, mask = token_logps(logits_of(outputs), batch["labels"], self.cfg.temperature)
        keep = batch["keep"].float()
        mask = mask & keep.bool()[:, None]
        logps = logps * mask
        if self.cfg.name == "rloo":
            losses, ratio = self._rloo(logps, batch, mask, keep)
            kl = None
        else:
            losses, ratio, kl = self._grpo(logps, batch, mask)
        self._keep_metrics(ratio, batch["advantages"].float(), entropy, kl, mask)
        return losses, torch.tensor(float(self.count(batch)), device=logps.device)

    def _rloo(
        self, logps: torch.Tensor, batch: dict[str, torch.Tensor], mask: torch.Tensor, keep: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rloo's summed per-row loss over the kept rows, the per-row ratio broadcast over the tokens)."""
        import torch

        sums = logps.sum(-1)
        old = batch.get("old_logps")
        old_sums = sums.detach() if old is None else (old.float() * mask).sum(-1)
        ratio = torch.exp(sums - old_sums)
        advantages = batch["advantages"].float()
        clipped = torch.clamp(ratio, 1 - self.cfg.epsilon, 1 + self.epsilon_high)
        losses = -torch.min(ratio * advantages, clipped * advantages) * keep
        return losses.sum(), ratio[:, None].expand_as(logps)

    def _keep_metrics(
        self,
        ratio: torch.Tensor,
        advantages: torch.Tensor,
        entropy: torch.Tensor,
        kl: torch.Tensor | None,
        mask: torch.Tensor,
    ) -> None:
        """Add the batch's clipped-token counts, entropy and KL sums to the log interval's."""
        import torch

        with torch.no_grad():
            a = advantages[:, None]
            low = (ratio < 1 - self.cfg.epsilon) & (a < 0) & mask
            high = (ratio > 1 + self.epsilon_high) & (a > 0) & mask
            zero = torch.zeros((), device=mask.device)
            sums = [
                low.sum(), high.sum(), (low | high).sum(), (entropy * mask).sum(),
                (kl * mask).sum() if kl is not None else zero, mask.sum(),
            ]  # fmt: skip
            total = torch.stack([s.float() for s in sums])
        self._sums = total if self._sums is None else self._sums + total

    def metrics(self, data_sum: Callable[[list[float]], list[float]]) -> dict[str, float]:
        """clip_ratio/*, entropy and (beta > 0) kl token means since the last call, over data-parallel ranks."""
        sums, self._sums = self._sums, None
        values = [0.0] * len(METRIC_SLOTS) if sums is None else [float(x) for x in sums.tolist()]
        low, high, region, entropy, kl, tokens = data_sum(values)
        tokens = max(tokens, 1.0)
        record = {
            "clip_ratio/low_mean": low / tokens,
            "clip_ratio/high_mean": high / tokens,
            "clip_ratio/region_mean": region / tokens,
            "entropy": entropy / tokens,
        }
        if self.cfg.beta != 0.0 and self.cfg.name == "grpo":
            record["kl"] = kl / tokens
        return record


def frozen_model(objective: ObjectiveConfig, distill: DistillConfig, *, adapters: bool) -> FrozenModel | None:
    """The reference when objective.beta > 0: the policy's base with adapters off (LoRA), else a frozen copy."""
    if objective.beta == 0.0:
        return None
    return FrozenModel(source="adapters_off" if adapters else "copy")


def build(objective: ObjectiveConfig, distill: DistillConfig, frozen: Frozen | None) -> PolicyGradient:
    """The online RL objective, reading its placed reference (None: beta 0, none)."""
    return PolicyGradient(objective, frozen)
