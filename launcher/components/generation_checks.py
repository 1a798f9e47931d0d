"""Generation checks' pure parts: the prompts file read and judged, a completion scored against its reference,
accuracy and the unbiased pass@k estimator of Chen et al. (2021), "Evaluating Large Language Models Trained on
Code", eq. 1.

The prompts file (`eval.generation.prompts`) is JSONL: one object per line with the prompt text
(`eval.generation.prompt_field`, default `prompt`) and its reference answer (`answer_field`, default
`answer`: a string or a number; with `match=regex`, the pattern the answer must match whole). Blank
lines are skipped; other fields are ignored. A line that is not such an object is refused before
launch, its file and line named (`PromptsFileError`). The answer is taken from a completion by the
reward group's verifiers (launcher.components.rewards.verifiers: extract_answer, answers_match,
regex_match). No torch here: the rules read the file before launch, the rank evaluator
(launcher.rank.eval_generation) generates and calls `is_correct` and `scores`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from launcher.components.rewards.verifiers import answers_match, extract_answer, regex_match
from launcher.config.eval import GenerationEvalConfig


class PromptsFileError(ValueError):
    """A prompts file that cannot be read, or one of its lines that is not a prompt with its answer."""


@dataclass(frozen=True, kw_only=True)
class Check:
    """One prompt of the file and the reference its answer is compared with."""

    prompt: str
    """The prompt text, as the file holds it."""
    reference: str
    """The reference answer as text (a number as JSON writes it), or the pattern with match=regex."""
    line: int
    """Its line in the file (1-based), for messages."""


def _problem(record: object, cfg: GenerationEvalConfig) -> str | None:
    """Why one decoded line is not a prompt with its reference answer, or None."""
    if not isinstance(record, dict):
        return f"it is a JSON {type(record).__name__}, not an object with '{cfg.prompt_field}' and '{cfg.answer_field}'"
    prompt, answer = record.get(cfg.prompt_field), record.get(cfg.answer_field)
    if not isinstance(prompt, str) or not prompt:
        found = "no such field" if prompt is None else f"{prompt!r}"
        return f"its '{cfg.prompt_field}' is not a non-empty string ({found}); eval.generation.prompt_field names it"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        found = "no such field" if answer is None else f"{answer!r}"
        return f"its '{cfg.answer_field}' is not a string or a number ({found}); eval.generation.answer_field names it"
    if cfg.match == "regex":
        try:
            re.compile(str(answer))
        except re.error as err:
            return f"its '{cfg.answer_field}' is not a regular expression (match=regex): {err}"
    return None


def read_checks(cfg: GenerationEvalConfig) -> list[Check]:
    """The file's prompts and references (its first `cfg.limit`); PromptsFileError names the file and the line."""
    path = Path(str(cfg.prompts))
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise PromptsFileError(
            f"cannot read the prompts file {path} ({type(err).__name__}: {err}). Give a readable JSONL file."
        ) from None
    checks: list[Check] = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            reason = f"it is not JSON ({err.msg}, column {err.colno})"
        else:
            reason = _problem(record, cfg)
        if reason is not None:
            raise PromptsFileError(
                f"{path}, line {number}: {reason}. Each line is one JSON object such as "
                f'{{"{cfg.prompt_field}": "2+3=", "{cfg.answer_field}": "5"}}; fix or remove the line.'
            )
        answer = record[cfg.answer_field]
        checks.append(Check(prompt=record[cfg.prompt_field], reference=str(answer), line=number))
        if cfg.limit is not None and len(checks) == cfg.limit:
            break
    if not checks:
        raise PromptsFileError(f"{path} holds no prompt (every line is blank).")
    return checks


def is_correct(completion: str, reference: str, cfg: GenerationEvalConfig) -> bool:
    """Whether the answer `cfg.extract` takes from `completion` matches `reference` as `cfg.match` compares."""
    answer = extract_answer(completion, cfg.extract)
    if cfg.match == "regex":
        return answer is not None and regex_match(answer, reference)
    return answers_match(answer, reference, cfg.match)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def scores(correct: Sequence[int], cfg: GenerationEvalConfig) -> dict[str, float]:
    """The records from each prompt's count of correct samples: accuracy (over every sample) and pass@k."""
    n, names = cfg.samples, cfg.metrics()
    out = {names[0]: sum(correct) / (len(correct) * n)}
    for name, k in zip(names[1:], cfg.pass_at, strict=True):
        out[name] = sum(pass_at_k(n, c, k) for c in correct) / len(correct)
    return out
