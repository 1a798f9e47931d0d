"""Schema of the reward group: the built-in verifiable rewards and a user's own reward functions, weighted and summed.

What the group builds at run time lives in launcher.components.rewards (docs/rewards.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TERMS = ("answer", "format", "length")
"""The built-in rewards, in the order they are computed (before the user's functions)."""
EXTRACTIONS = ("last_number", "boxed", "tag:NAME", "none")
"""How reward.answer.extract finds the answer (tag takes a name: tag:answer); several joined by | are tried in order."""
MATCHES = ("exact", "numeric", "math_verify")
"""How reward.answer.match compares the extracted answer with the record's."""
CHECKPOINT_KEY = "reward_files"
"""The key of a checkpoint's manifest that records each reward file's sha256 (its path as written -> digest)."""


@dataclass(frozen=True, kw_only=True)
class AnswerReward:
    """1.0 when the answer extracted from a completion matches the record's reference answer, else 0.0."""

    weight: float | None = None
    """Its weight in the summed reward; null: not computed (0: computed and logged, not trained on)."""
    field: str = "answer"
    """The record field holding the reference answer."""
    extract: str = "boxed|last_number"
    """How the answer is found in the completion: last_number, boxed (the last \\boxed{}), tag:NAME (the last
    <NAME>...</NAME>) or none (the whole text); several joined by | are tried in order."""
    match: str = "numeric"
    """exact (equal strings), numeric (equal numbers: 0.5 == 1/2 == .50) or math_verify (symbolic; needs math-verify)."""


@dataclass(frozen=True, kw_only=True)
class FormatReward:
    """1.0 when the whole completion matches a regex, else 0.0."""

    weight: float | None = None
    """Its weight in the summed reward; null: not computed (0: computed and logged, not trained on)."""
    pattern: str = r"<think>.*</think>\s*<answer>.*</answer>"
    """A Python regex the whole completion (stripped) must match; `.` matches newlines too."""


@dataclass(frozen=True, kw_only=True)
class LengthReward:
    """DAPO's soft overlong penalty over completion tokens: 0, then falling linearly to -1 at max_tokens."""

    weight: float | None = None
    """Its weight in the summed reward; null: not computed (0: computed and logged, not trained on)."""
    max_tokens: int | None = None
    """Completion tokens at which the penalty reaches -1 (and stays there beyond); required when weight is set."""
    soft_tokens: int = 0
    """The penalty falls from 0 to -1 over the last soft_tokens before max_tokens (0: a step at max_tokens)."""


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """The rewards of an online RL objective: built-in terms and user functions, each weighted, summed per completion."""

    answer: AnswerReward = field(default_factory=AnswerReward)
    format: FormatReward = field(default_factory=FormatReward)
    length: LengthReward = field(default_factory=LengthReward)
    functions: list[str] = field(default_factory=list)
    """A user's own rewards, each "path/to/file.py:function" with TRL's signature (prompts, completions, **record_fields)
    -> list[float]; the file is read on every launch and rank start, never from a checkpoint."""
    function_weights: list[float] = field(default_factory=list)
    """The weight of each of reward.functions, in order; empty: 1.0 each."""
    digests: list[str] = field(default_factory=list)
    """Written by the launcher: the sha256 of each of reward.functions' files, in order, as they were when the run
    started; a spec that carries them (a reproduction, a resume) is refused when a file changed since."""
    allow_changed_files: bool = False
    """Accept reward files that changed since the run (or the spec.yaml reproduced) recorded them; the new digests are recorded."""

    def terms(self) -> list[tuple[str, AnswerReward | FormatReward | LengthReward]]:
        """(name, settings) of each built-in reward that is on (its weight set), in TERMS order."""
        chosen = ((name, getattr(self, name)) for name in TERMS)
        return [(name, term) for name, term in chosen if term.weight is not None]

    def configured(self) -> bool:
        """Whether any reward is configured (a built-in term or a function)."""
        return bool(self.terms() or self.functions)

    def names(self) -> list[str]:
        """Every reward's name, in order: the built-in terms that are on, then each function's name."""
        return [name for name, _ in self.terms()] + [function_name(f) for f in self.functions]


def recorded_files(cfg: RewardConfig) -> dict[str, str]:
    """Each reward file's path as reward.functions writes it -> the digest reward.digests recorded for it."""
    return {split_function(e)[0]: d for e, d in zip(cfg.functions, cfg.digests, strict=False)}


def checkpoint_record(cfg: RewardConfig) -> dict[str, dict[str, str]]:
    """What a checkpoint's manifest records of the rewards: the digest of each reward file (nothing without one)."""
    files = recorded_files(cfg)
    return {CHECKPOINT_KEY: files} if files else {}


def split_function(entry: str) -> tuple[str, str]:
    """("path/to/file.py", "function") of a reward.functions entry (the last ':' splits them; "" when missing)."""
    path, sep, name = entry.rpartition(":")
    return (path, name) if sep else (entry, "")


def function_name(entry: str) -> str:
    """A reward.functions entry's name in metrics: the function's own name."""
    return split_function(entry)[1] or entry
