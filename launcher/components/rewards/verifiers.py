"""Verifiable answers: pull an answer out of a completion, compare it with a reference, match a format.

Pure functions of strings, no spec and no torch: the built-in rewards (launcher.components.rewards) are
made of them, and a user's own reward file may import them too.

- `extract_answer(text, how)`: `last_number` (the last number written, thousands separators dropped),
  `boxed` (the content of the last `\\boxed{...}`, braces balanced), `tag:NAME` (the text between the last
  `<NAME>` and its `</NAME>`), `none` (the whole text); several joined by `|` are tried in order
  (`boxed|last_number`: the boxed answer, else the last number). Every answer comes back stripped; None
  when the text holds none.
- `answers_match(predicted, reference, mode)`: `exact` (equal once surrounding whitespace is stripped),
  `numeric` (equal as exact rationals: 0.5 == 1/2 == .50 == 1e-1*5, `$`, `%` and thousands separators
  ignored; text that is not a number matches only itself, as exact), `math_verify` (the math-verify
  package's symbolic equivalence, which needs it installed).
- `regex_match(text, pattern)`: the pattern must match the WHOLE text, surrounding whitespace stripped,
  with `.` matching newlines too (Python's `re.fullmatch` with `re.DOTALL`).
"""

from __future__ import annotations

import importlib.util
import re
import threading
from typing import TYPE_CHECKING

from launcher.config.reward import EXTRACTIONS, MATCHES

if TYPE_CHECKING:  # imported where used: the launching process (rules, --help) seldom needs it
    from fractions import Fraction

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_TAG_NAME = re.compile(r"[A-Za-z_][\w.-]*")


def extraction_problem(how: str) -> str | None:
    """Why `how` is not an extraction `extract_answer` knows (None when it is one)."""
    for part in how.split("|"):
        name, sep, tag = part.partition(":")
        if name == "tag" and sep and _TAG_NAME.fullmatch(tag):
            continue
        if name == "tag":
            return f"'{part}' names no tag: write tag:NAME, e.g. tag:answer for <answer>...</answer>"
        if sep or name not in ("last_number", "boxed", "none"):
            return f"'{part}' is not an extraction (known: {', '.join(EXTRACTIONS)}, joined by | to try in order)"
    return None


def extract_answer(text: str, how: str) -> str | None:
    """The answer `how` finds in `text`, stripped; None when there is none (see the module's list)."""
    problem = extraction_problem(how)
    if problem is not None:
        raise ValueError(problem)
    for part in how.split("|"):
        found = _extract_one(text, part)
        if found is not None:
            return found
    return None


def _extract_one(text: str, how: str) -> str | None:
    if how == "none":
        return text.strip()
    if how == "last_number":
        numbers = _NUMBER.findall(text)
        return numbers[-1].replace(",", "") if numbers else None
    if how == "boxed":
        return _last_boxed(text)
    name = how.partition(":")[2]
    start, end = f"<{name}>", f"</{name}>"
    stop = text.rfind(end)
    begin = text.rfind(start, 0, stop) if stop >= 0 else -1
    return text[begin + len(start) : stop].strip() if begin >= 0 else None


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces kept; None when unclosed or absent."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def as_number(text: str) -> Fraction | None:
    """`text` as an exact rational (0.5, 1/2, .50, -3, 1,000, 1e3, $5, 40%), None when it is not a number."""
    from fractions import Fraction

    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "")
    percent = cleaned.endswith("%")
    cleaned = cleaned.removesuffix("%").rstrip(".")
    try:
        value = Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def math_verify_installed() -> bool:
    """Whether the math-verify package can be imported (answers_match's math_verify mode needs it), without importing it."""
    try:
        return importlib.util.find_spec("math_verify") is not None
    except (ImportError, ValueError):  # a blocked or broken entry in sys.modules
        return False


def answers_match(predicted: str | None, reference: str, mode: str) -> bool:
    """Whether an extracted answer equals the reference under `mode` (exact, numeric, math_verify); None never does."""
    if mode not in MATCHES:
        raise ValueError(f"'{mode}' is not a match mode (known: {', '.join(MATCHES)})")
    if predicted is None:
        return False
    if mode == "exact":
        return predicted.strip() == reference.strip()
    if mode == "numeric":
        left, right = as_number(predicted), as_number(reference)
        if left is None or right is None:
            return predicted.strip() == reference.strip()
        return left == right
    return _math_verify(predicted, reference)


def _math_verify(predicted: str, reference: str) -> bool:
    """math-verify's equivalence of the two answers (its timeouts use signals, so only on the main thread)."""
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_as_latex(reference), parsing_timeout=timeout)
    answer = parse(_as_latex(predicted), parsing_timeout=timeout)
    if not gold or not answer:
        return predicted.strip() == reference.strip()
    return bool(verify(gold, answer, timeout_seconds=timeout))


def _as_latex(text: str) -> str:
    """A bare answer in math delimiters, so math-verify reads it as one expression (a boxed or $..$ one is kept)."""
    stripped = text.strip()
    return stripped if "$" in stripped or "\\boxed" in stripped else f"${stripped}$"


def regex_match(text: str, pattern: str) -> bool:
    """Whether `pattern` matches the whole of `text` (surrounding whitespace stripped; `.` matches newlines)."""
    return re.fullmatch(pattern, text.strip(), flags=re.DOTALL) is not None
