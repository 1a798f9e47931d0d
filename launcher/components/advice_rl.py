"""The advisor's rules over online RL records (grpo, rloo): flat rewards, collapsing completion length.

They read the keys the rollout source logs (launcher.rank.rollout_scoring): `equal_groups`, the share of
groups whose rewards were all equal (no learning signal: every advantage 0), and `completion_length`,
the completions' mean length. Pure Python, no torch, as the other rules (launcher.components.advice_rules).
"""

from __future__ import annotations

import math
from typing import Any

FLAT_SHARE = 0.95
"""A record whose equal_groups reaches this share has (nearly) no group with a learning signal."""
FLAT_RECORDS = 5
"""Consecutive flat records (after the first) before the advisor speaks."""
COLLAPSE_SHARE = 0.35
"""Completions whose mean length fell below this share of the longest mean seen have collapsed..."""
COLLAPSE_RECORDS = 3
"""...for this many consecutive records..."""
COLLAPSE_FROM_TOKENS = 8.0
"""...from a longest mean of at least this many tokens (a task answered in a token or two is no collapse)."""


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class FlatRewards:
    """Every group's rewards are equal record after record: the advantages are all 0 and nothing trains."""

    id = "flat_rewards"

    def __init__(self) -> None:
        self._seen = 0
        self._flat = 0

    def check(self, record: dict[str, Any]) -> str | None:
        share = record.get("equal_groups")
        if not _finite(share):
            return None
        self._seen += 1
        self._flat = self._flat + 1 if self._seen > 1 and share >= FLAT_SHARE else 0
        if self._flat < FLAT_RECORDS:
            return None
        return (
            f"{share:.0%} of the groups had all-equal rewards for {self._flat} records (reward {record.get('reward', 0):.3g}): "
            "every advantage is 0, so the policy does not move. The task is too hard or too easy for the model as "
            "it is (all 0 or all 1): make the reward partial (e.g. a format reward beside the answer), pick prompts "
            "at the model's level, raise objective.num_generations or objective.temperature."
        )


class CollapsingLength:
    """The completions' mean length falls far below its longest: the policy learnt to answer with (almost) nothing."""

    id = "collapsing_length"

    def __init__(self) -> None:
        self._longest = 0.0
        self._short = 0

    def check(self, record: dict[str, Any]) -> str | None:
        length = record.get("completion_length")
        if not _finite(length):
            return None
        self._longest = max(self._longest, length)
        short = self._longest >= COLLAPSE_FROM_TOKENS and length < COLLAPSE_SHARE * self._longest
        self._short = self._short + 1 if short else 0
        if self._short < COLLAPSE_RECORDS:
            return None
        return (
            f"completion_length fell to {length:.3g} tokens from {self._longest:.3g} and stayed there {self._short} "
            "records: the policy found that short completions score (or lose) least. Check the rewards for a length "
            "bias (a penalty that outweighs the answer, or an answer reward that a bare number wins), use "
            "objective.loss_type=dr_grpo or dapo (per-sequence means favour short wrong answers), or lower optimizer.lr."
        )


def rl_rules() -> list[Any]:
    """The online RL rules, in the order they are checked."""
    return [FlatRewards(), CollapsingLength()]
