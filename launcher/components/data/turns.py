"""A message's own training flags and reasoning trace, read from the layouts that carry them.

- OpenAI fine-tuning files: `weight` 0 (do not train this turn) or 1 (train it);
- axolotl's chat_template: `train` (or `training`) true/false, and `train_detail`, a list of
  {begin_offset, end_offset, train} character spans of the content (end_offset inclusive; characters
  of the content no span covers are not trained, as axolotl does);
- content given as parts: a part's own `train` true/false covers that part's characters;
- reasoning: `reasoning_content` (OpenAI/DeepSeek/Qwen3), `reasoning`, content parts of type
  `reasoning` or `thinking`, or a `<think>...</think>` block that opens an assistant turn's content.

They travel on the normalized message under TRAIN_KEY and SPANS_KEY (render.py strips both before the
chat template sees the message) and REASONING_KEY, the name chat templates read reasoning from.
"""

from __future__ import annotations

import re
from typing import Any

from launcher.components.data.sources import RecordError

TRAIN_KEY = "_train"
"""The turn's own flag (True/False); absent: the default (assistant turns trained, the rest with data.train_on=all)."""
SPANS_KEY = "_spans"
"""Character spans of the content: (begin, end exclusive, trained), later spans over earlier ones; trained None
marks a reasoning block (trained with its turn unless data.train_reasoning=false)."""
REASONING_KEY = "reasoning_content"
"""Where a message's reasoning trace is kept: the name Qwen3's, DeepSeek's and GLM's chat templates read."""
THINK_KEY = "_think_chars"
"""How many characters of the content are the `<think>` block render.py wrote before it (templates with no reasoning)."""
THINK_TEXT_KEY = "_think_text"
"""The `<think>` block as the content opened with it, written back as it was where the template has no reasoning."""
PRIVATE_KEYS = (TRAIN_KEY, SPANS_KEY, THINK_KEY, THINK_TEXT_KEY)
REASONING_PARTS = {"reasoning": ("reasoning", "text"), "thinking": ("thinking", "text")}
"""Content-part types that hold reasoning -> the keys their text may sit under."""
THINK_OPENING = re.compile(r"\s*<think>(.*?)</think>\s*", re.DOTALL)
"""A `<think>` block that opens an assistant turn's content."""


def turn_flag(message: dict, where: str) -> bool | None:
    """The message's own trained flag from `weight` (0/1) or `train`/`training` (true/false); None when it has none."""
    weight = message.get("weight")
    if weight is not None and (isinstance(weight, bool) or weight not in (0, 1)):
        raise RecordError(
            f"{where}.weight is {weight!r}; OpenAI's layout takes 0 (do not train this turn) or 1."
        )
    train = message.get("train", message.get("training"))
    if train is not None and not isinstance(train, bool):
        raise RecordError(f"{where}.train is {train!r}; it takes true (train this turn) or false.")
    if weight is not None and train is not None and bool(weight) != train:
        raise RecordError(f"{where} has weight {weight} and train {train}: they disagree. Keep one of them.")
    return train if train is not None else None if weight is None else weight == 1


def detail_spans(detail: Any, content: str, where: str) -> list[tuple[int, int, bool]]:
    """axolotl's `train_detail` as spans: the whole content untrained, then each {begin_offset, end_offset, train}."""
    hint = "train_detail is a list of {begin_offset, end_offset, train} (character offsets, end inclusive)"
    if not isinstance(detail, list):
        raise RecordError(f"{where}.train_detail is {type(detail).__name__}; {hint}.")
    spans = [(0, len(content), False)]
    for j, item in enumerate(detail):
        begin = item.get("begin_offset") if isinstance(item, dict) else None
        end = item.get("end_offset") if isinstance(item, dict) else None
        train = item.get("train") if isinstance(item, dict) else None
        if not (isinstance(begin, int) and isinstance(end, int) and isinstance(train, bool)):
            raise RecordError(f"{where}.train_detail[{j}] is {str(item)[:80]}; {hint}.")
        if not 0 <= begin <= end < len(content):
            raise RecordError(
                f"{where}.train_detail[{j}] spans characters {begin}..{end}, outside the content's "
                f"{len(content)} characters (offsets count from 0, end_offset inclusive)."
            )
        spans.append((begin, end + 1, train))
    return spans


def part_reasoning(part: dict, kind: str, where: str) -> str:
    """The text of a reasoning content part ({type: reasoning, reasoning: ...} or thinking, or under `text`)."""
    text = next((part[k] for k in REASONING_PARTS[kind] if isinstance(part.get(k), str)), None)
    if text is None:
        raise RecordError(
            f"{where} is a '{kind}' part with no text under {' or '.join(REASONING_PARTS[kind])}."
        )
    return text


def reasoning_of(message: dict, from_parts: list[str], where: str) -> str | None:
    """The message's reasoning from `reasoning_content`, `reasoning` and reasoning parts (joined by newlines)."""
    found = list(from_parts)
    for key in (REASONING_KEY, "reasoning"):
        value = message.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise RecordError(f"{where}.{key} is {type(value).__name__}, not a string.")
        found.insert(0, value)
    return "\n".join(found) if found else None


def opening_think(content: str) -> tuple[str, str, str] | None:
    """(reasoning, the rest of the content, the block as written) when the content opens with a <think> block."""
    match = THINK_OPENING.match(content)
    return (match.group(1).strip("\n"), content[match.end() :], match.group(0)) if match else None


def turn_extras(
    message: dict, role: str, content: str, spans: list, reasoning_parts: list[str], where: str
) -> tuple[str, dict[str, Any]]:
    """(content, the keys to add to the normalized message): flags, spans and reasoning of one turn."""
    extras: dict[str, Any] = {}
    flag = turn_flag(message, where)
    if flag is not None:
        extras[TRAIN_KEY] = flag
    if message.get("train_detail") is not None:
        spans = [*spans, *detail_spans(message["train_detail"], content, where)]
    reasoning = reasoning_of(message, reasoning_parts, where)
    if reasoning is not None and role != "assistant":
        raise RecordError(f"{where} carries reasoning but has role {role!r}; only assistant turns reason.")
    if reasoning is None and role == "assistant" and not spans:
        opened = opening_think(content)
        if opened is not None:
            reasoning, content, extras[THINK_TEXT_KEY] = opened
    if reasoning is not None:
        extras[REASONING_KEY] = reasoning
    if spans:
        extras[SPANS_KEY] = spans
    return content, extras
