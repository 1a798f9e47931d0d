"""The built-in rewards (reward.answer, reward.format, reward.length), each a function of the completions' texts,
records and token counts.

- answer: 1.0 when the answer `extract` finds in the completion matches the record's `field` under `match`, else 0.0;
- format: 1.0 when the whole completion (stripped) matches `pattern`, else 0.0;
- length: DAPO's soft overlong penalty (TRL's `get_soft_overlong_punishment`), over completion tokens: 0 up to
  max_tokens - soft_tokens, then falling linearly to -1 at max_tokens, and -1 beyond.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from launcher.components.rewards.verifiers import answers_match, extract_answer, regex_match
from launcher.config.reward import AnswerReward, FormatReward, LengthReward

TermFn = Callable[[Sequence[str], Sequence[dict[str, Any]], Sequence[int] | None], list[float]]
"""(completion texts, records, completion token counts or None) -> one reward per completion."""


class MissingField(ValueError):
    """A record lacks the field an answer term compares with; `row` is its index in the batch."""

    def __init__(self, message: str, row: int) -> None:
        super().__init__(message)
        self.row = row


def build_term(term: AnswerReward | FormatReward | LengthReward) -> TermFn:
    """The function computing one built-in reward."""
    if isinstance(term, AnswerReward):
        return lambda texts, records, counts: _answer(term, texts, records)
    if isinstance(term, FormatReward):
        return lambda texts, records, counts: [1.0 if regex_match(t, term.pattern) else 0.0 for t in texts]
    return lambda texts, records, counts: _length(term, counts)


def _answer(term: AnswerReward, texts: Sequence[str], records: Sequence[dict[str, Any]]) -> list[float]:
    rewards = []
    for row, (text, record) in enumerate(zip(texts, records, strict=True)):
        if term.field not in record:
            raise MissingField(
                f"the record has no field '{term.field}' (its fields: {', '.join(sorted(record)) or 'none'}); "
                "set reward.answer.field to the field holding the reference answer",
                row,
            )
        predicted = extract_answer(text, term.extract)
        rewards.append(1.0 if answers_match(predicted, str(record[term.field]), term.match) else 0.0)
    return rewards


def soft_length_penalty(num_tokens: int, max_tokens: int, soft_tokens: int) -> float:
    """0 up to max_tokens - soft_tokens, then linear down to -1 at max_tokens, -1 beyond (DAPO, Eq. 13)."""
    start = max_tokens - soft_tokens
    if num_tokens <= start:
        return 0.0
    if num_tokens <= max_tokens:
        return (start - num_tokens) / soft_tokens
    return -1.0


def _length(term: LengthReward, counts: Sequence[int] | None) -> list[float]:
    if counts is None:
        raise ValueError(
            "the length reward counts completion tokens, and no completion_ids were given to score"
        )
    assert term.max_tokens is not None, (
        "the rules require reward.length.max_tokens when reward.length.weight is set"
    )
    return [soft_length_penalty(n, term.max_tokens, term.soft_tokens) for n in counts]
