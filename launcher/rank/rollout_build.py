"""The rollout step source of an online RL run (grpo, rloo), built from the spec on a rank.

The prompts (data.format=prompt) are read and encoded here, all of them (launcher.components.data.prompts);
the rewards are the reward group's (launcher.components.rewards.build_rewards, user files read again here,
never from a checkpoint); generation's context is data.seq_len, which the rules check every prompt plus
objective.max_completion_length fits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from launcher.components.data.prompts import read_prompts
from launcher.components.data.tokenizer import load_tokenizer
from launcher.components.data.tokens import cache_root
from launcher.rank.rollout_scoring import Rewards, RewardScoring
from launcher.rank.rollouts import RolloutSource, Scoring
from launcher.spec import RunSpec


def reward_set(spec: RunSpec) -> Rewards:
    """The reward group's RewardSet of the spec (its user files read and checked against their recorded digests)."""
    from launcher.components.rewards import build_rewards

    return build_rewards(spec.reward, Path.cwd())


def build_rollouts(
    spec: RunSpec, dtype: torch.dtype, run_dir: Path | None, scoring: Scoring | None = None
) -> RolloutSource:
    """This rank's rollout source: every prompt, the tokenizer, and the scoring (default: the rewards)."""
    tokenizer = load_tokenizer(spec.tokenizer)
    prompts = [p for _, p in read_prompts(spec.data, spec.tokenizer, tokenizer, cache_root(spec.data))]
    if scoring is None:
        scoring = RewardScoring(reward_set(spec), spec.objective, dtype, spec.train.max_steps)
    return RolloutSource(
        prompts, objective=spec.objective, tokenizer=tokenizer, scoring=scoring, seed=spec.train.seed,
        context=spec.data.seq_len, dtype=dtype, run_dir=run_dir,
    )  # fmt: skip
