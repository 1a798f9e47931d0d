"""Rewards as the rollout source's scoring (grpo, rloo): reward functions -> advantages, and the reward metrics.

The reward set (the reward group's `RewardSet`, or anything with its `score(prompts, completions,
fields)` returning `.total` and `.per_function`) scores every row; the soft overlong penalty
(objective.overlong_buffer, DAPO) is added; rloo with objective.beta > 0 subtracts beta x the rows'
summed log-ratio of the sampling policy to the reference (TRL's RLOO); then each group's advantages
(launcher.components.objectives.policy_gradient.group_advantages). Rows are scored on the rank that
sampled them: a group never spans ranks, so its advantages need no collective.

`keep` is 0 on the rows of a group whose rewards are all equal under objective.drop_equal_groups, and
on truncated rows under objective.mask_truncated_completions (TRL masks their tokens out): the
objective leaves them out of the loss and its count. A step that would keep no row on any rank keeps
them all with zero advantages instead (the step learns nothing but the KL, rather than dividing 0 by 0).

Metrics (summed over data-parallel ranks at each log step): reward and reward_std (over the interval's
rollouts), reward/<function> and reward_std/<function>, equal_groups (share of groups whose rewards
are all equal), completion_length and completion_length_max, clipped_share (completions cut at
objective.max_completion_length).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as tdist

from launcher.components.objectives.policy_gradient import group_advantages, sequence_kl
from launcher.config.objective import ObjectiveConfig
from launcher.rank.rollouts import Rollouts, policy_logps
from launcher.rank.sources import SourceContext


class Scores(Protocol):
    """What a reward set returns: the weighted total and each function's own rewards, one per completion."""

    total: list[float]
    per_function: dict[str, list[float]]


class Rewards(Protocol):
    """The reward group's RewardSet as the rollouts use it."""

    def score(
        self,
        prompts: list[str],
        completions: list[str],
        fields: list[dict[str, Any]],
        *,
        completion_ids: list[list[int]] | None = None,
        step: int = 0,
        max_steps: int = 0,
    ) -> Scores:
        """Rewards of each (prompt, completion) with the record's other fields; raises RewardError naming the function."""
        ...


def overlong_penalty(lengths: torch.Tensor, cfg: ObjectiveConfig) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max - buffer tokens, then down linearly to -overlong_penalty at max."""
    if cfg.overlong_buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    start = cfg.max_completion_length - cfg.overlong_buffer
    over = (lengths.float() - start).clamp(min=0)
    return -over / cfg.overlong_buffer * cfg.overlong_penalty


def _mean_std(total: float, squares: float, count: float) -> tuple[float, float]:
    mean = total / max(count, 1.0)
    return mean, math.sqrt(max(squares / max(count, 1.0) - mean * mean, 0.0))


class RewardScoring:
    """The rollout source's Scoring for grpo and rloo: rewards, advantages, keep; and their metrics."""

    def __init__(
        self, rewards: Rewards, cfg: ObjectiveConfig, dtype: torch.dtype, max_steps: int = 0
    ) -> None:
        self.rewards, self.cfg, self.dtype, self.max_steps = rewards, cfg, dtype, max_steps
        self.device = torch.device("cpu")  # where the all-reduce of the longest completion runs
        self.functions: list[str] | None = None
        self._sums: list[float] | None = None
        self._longest = 0

    def score(self, rollouts: Rollouts, ctx: SourceContext) -> dict[str, torch.Tensor]:
        """reward, advantages and keep [rows] of a step's rollouts."""
        if tdist.is_available() and tdist.is_initialized() and tdist.get_backend() != "gloo":
            self.device = ctx.dist.device
        scores = self._scores(rollouts)
        lengths = torch.tensor([len(c) for c in rollouts.completions])
        reward = torch.tensor(scores.total, dtype=torch.float32) + overlong_penalty(lengths, self.cfg)
        shaped = reward
        if self.cfg.name == "rloo" and self.cfg.beta != 0.0:
            shaped = reward - self.cfg.beta * self._kl(rollouts, ctx)
        n = rollouts.group_size
        equal = (reward.view(-1, n) == reward.view(-1, n)[:, :1]).all(1)
        advantages = group_advantages(shaped.view(-1, n), self.cfg).reshape(-1)
        keep = torch.ones_like(reward)
        if self.cfg.drop_equal_groups:
            keep = keep * (~equal).float().repeat_interleave(n)
        truncated = torch.tensor(rollouts.truncated, dtype=torch.bool)
        if self.cfg.mask_truncated_completions:
            keep = keep * (~truncated).float()
        if not self._any_kept(keep):  # nothing left on any rank: a step with no advantage, not 0 / 0
            keep, advantages = torch.ones_like(keep), torch.zeros_like(advantages)
        self._add(reward, scores.per_function, equal, lengths, truncated)
        return {"reward": reward, "advantages": advantages, "keep": keep}

    def _any_kept(self, keep: torch.Tensor) -> bool:
        """Whether any rank keeps a row of this step (one all-reduce where rows can be dropped)."""
        if not (self.cfg.drop_equal_groups or self.cfg.mask_truncated_completions):
            return True
        kept = torch.tensor([float(keep.sum())], device=self.device)
        if tdist.is_available() and tdist.is_initialized():
            tdist.all_reduce(kept)
        return float(kept.item()) > 0

    def _scores(self, rollouts: Rollouts) -> Scores:
        """The reward set's scores; a reward that fails on any rank stops every rank here (one all-reduce), the
        failing rank with its RewardError, the others with one that names the failure elsewhere."""
        from launcher.components.rewards import RewardError

        failure: RewardError | None = None
        try:
            scores = self.rewards.score(
                [p.text for p in rollouts.prompts], rollouts.texts, [dict(p.fields) for p in rollouts.prompts],
                completion_ids=rollouts.completions, step=rollouts.step, max_steps=self.max_steps,
            )  # fmt: skip
        except RewardError as err:
            failure = err
        failed = torch.tensor([0.0 if failure is None else 1.0], device=self.device)
        if tdist.is_available() and tdist.is_initialized():
            tdist.all_reduce(failed, op=tdist.ReduceOp.MAX)
        if failure is not None:
            raise failure
        if float(failed.item()) > 0:
            raise RewardError("(on another rank)", "(that rank's prompt)", "see that rank's error above")
        return scores

    def _kl(self, rollouts: Rollouts, ctx: SourceContext) -> torch.Tensor:
        """rloo's per-row KL: the sampling policy's summed log-ratio to the reference (both forwards under no_grad)."""
        rows = rollouts.rows
        size, device = ctx.batch.micro_batch_size, ctx.dist.device
        policy = policy_logps(rows, ctx, temperature=self.cfg.temperature, dtype=self.dtype)
        reference = []
        for i in range(0, len(rows["input_ids"]), size):
            part = {k: v[i : i + size].to(device) for k, v in rows.items()}
            reference.append(ctx.objective.reference_logps(part).cpu())  # type: ignore[attr-defined]
        mask = rows["labels"] != -100
        return sequence_kl(policy, torch.cat(reference), mask)

    def _add(
        self,
        reward: torch.Tensor,
        per_function: dict[str, list[float]],
        equal: torch.Tensor,
        lengths: torch.Tensor,
        truncated: torch.Tensor,
    ) -> None:
        """Add a step's numbers to the log interval's sums."""
        if self.functions is None:
            self.functions = sorted(per_function)
        values = [float(reward.sum()), float((reward**2).sum()), float(len(reward))]
        for name in self.functions:
            own = torch.tensor(per_function[name], dtype=torch.float64)
            own = own[~torch.isnan(own)]  # a user function's None: not scored
            values += [float(own.sum()), float((own**2).sum()), float(len(own))]
        values += [float(equal.sum()), float(len(equal)), float(lengths.sum()), float(truncated.sum())]
        self._sums = (
            values if self._sums is None else [a + b for a, b in zip(self._sums, values, strict=True)]
        )
        self._longest = max(self._longest, int(lengths.max()))

    def record(self, data_sum: Callable[[list[float]], list[float]]) -> dict[str, float]:
        """The interval's reward, per-function reward, equal-group and completion-length metrics."""
        functions = self.functions or []
        width = 3 + 3 * len(functions) + 4
        sums = data_sum(self._sums if self._sums is not None else [0.0] * width)
        if sums[2] == 0:  # no rollouts since the last record (objective.num_iterations > 1 reuses them)
            return {}
        longest = torch.tensor([float(self._longest)], device=self.device)
        if tdist.is_available() and tdist.is_initialized():
            tdist.all_reduce(longest, op=tdist.ReduceOp.MAX)
        self._sums, self._longest = None, 0
        rows = sums[2]
        record = dict(zip(("reward", "reward_std"), _mean_std(sums[0], sums[1], rows), strict=True))
        for k, name in enumerate(functions):
            mean, std = _mean_std(*sums[3 + 3 * k : 6 + 3 * k])
            record[f"reward/{name}"], record[f"reward_std/{name}"] = mean, std
        equal, groups, length, clipped = sums[-4:]
        record.update({
            "equal_groups": equal / max(groups, 1.0), "completion_length": length / max(rows, 1.0),
            "completion_length_max": float(longest.item()), "clipped_share": clipped / max(rows, 1.0),
        })  # fmt: skip
        return record
