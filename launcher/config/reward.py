"""Schema of the reward group: the built-in verifiable rewards and a user's own reward functions, weighted and summed.

What the group builds at run time lives in launcher.components.rewards (docs/rewards.md).
"""

from __future__ import annotations

from dataclasses import dataclass

TERM_KINDS = ("answer", "format", "length")
"""Built-in rewards: an extracted answer against a record field, a format regex, a soft length penalty."""


@dataclass(frozen=True, kw_only=True)
class RewardTerm:
    """One built-in reward (`reward.terms`): its kind, its weight in the sum, and the options of its kind."""

    kind: str = "answer"
    """answer (1 when the answer extracted from the completion matches the record's field, else 0), format (1 when the
    completion matches reward.terms[].pattern, else 0) or length (0 up to max_tokens - soft_tokens, falling to -1 at max_tokens)."""
    name: str | None = None
    """Its name in metrics (`reward/<name>`) and errors; null: the kind."""
    weight: float = 1.0
    """Its weight in the summed reward (any finite number; 0 logs it without training on it)."""
    field: str = "answer"
    """answer: the record field holding the reference answer."""
    extract: str = "boxed|last_number"
    """answer: how the answer is found in the completion: last_number, boxed, tag:NAME (<NAME>...</NAME>) or none
    (the whole text); several joined by | are tried in order."""
    match: str = "numeric"
    """answer: exact (equal strings), numeric (equal numbers: 0.5 == 1/2 == .50) or math_verify (symbolic, needs math-verify)."""
    pattern: str | None = None
    """format: a Python regex the whole completion (stripped) must match; `.` matches newlines too."""
    max_tokens: int | None = None
    """length: completion tokens at which the penalty reaches -1 (and stays there beyond)."""
    soft_tokens: int = 0
    """length: the penalty falls linearly from 0 to -1 over the last soft_tokens before max_tokens (0: a step at max_tokens)."""


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """The rewards of an online RL objective: built-in terms and user functions, each weighted, summed per completion."""

    terms: tuple[RewardTerm, ...] = ()
    """Built-in rewards, each entry: kind, name, weight, field, extract, match, pattern, max_tokens, soft_tokens."""
    functions: tuple[str, ...] = ()
    """A user's own rewards, each "path/to/file.py:function" with TRL's signature (prompts, completions, **record_fields)
    -> list[float]; the file is read on every launch and rank start, never from a checkpoint."""
    function_weights: tuple[float, ...] = ()
    """The weight of each of reward.functions, in order; empty: 1.0 each."""
    digests: tuple[str, ...] = ()
    """Written by the launcher: the sha256 of each of reward.functions' files, in order, as they were when the run
    started; a spec that carries them (a reproduction, a resume) is refused when a file changed since."""
    allow_changed_files: bool = False
    """Accept reward files that changed since the run (or the spec.yaml reproduced) recorded them; the new digests are recorded."""

    def __post_init__(self) -> None:
        for name in ("terms", "functions", "function_weights", "digests"):
            object.__setattr__(self, name, tuple(getattr(self, name)))  # OmegaConf builds lists

    def configured(self) -> bool:
        """Whether any reward is configured (a term or a function)."""
        return bool(self.terms or self.functions)

    def names(self) -> list[str]:
        """Every reward's name, in order: the terms' (name or kind), then each function's name."""
        return [t.name or t.kind for t in self.terms] + [function_name(f) for f in self.functions]


def split_function(entry: str) -> tuple[str, str]:
    """("path/to/file.py", "function") of a reward.functions entry (the last ':' splits them; "" when missing)."""
    path, sep, name = entry.rpartition(":")
    return (path, name) if sep else (entry, "")


def function_name(entry: str) -> str:
    """A reward.functions entry's name in metrics: the function's own name."""
    return split_function(entry)[1] or entry
