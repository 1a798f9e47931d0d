"""A conversation through the tokenizer's chat template, as text segments each trained or not.

Assistant turns (those that call tools included) are completions and are trained; system, user and
tool turns are prompt and are not, unless data.train_on=all. A turn's own flag (`weight`, `train`)
overrides that default, and its character spans (`train_detail`, content parts' `train`) override the
turn (turns.py reads them). Reasoning is rendered as the template renders `reasoning_content`; a
template that renders the conversation the same without it gets REASONING_BLOCK written before the
content instead (a `<think>` block the content opened with: as it was written). data.train_reasoning decides whether those characters are trained with their turn.
A template's own error (jinja2's TemplateError from `raise_exception`, or anything else
`apply_chat_template` raises) becomes a RecordError naming the record, the template's message and the
fix, so that it is refused before launch (exit status 2) instead of escaping as a traceback.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from launcher.components.data.chat import Conversation
from launcher.components.data.sources import RecordError
from launcher.components.data.tokenizer import Tokenizer
from launcher.components.data.turns import (
    PRIVATE_KEYS,
    REASONING_KEY,
    SPANS_KEY,
    THINK_KEY,
    THINK_TEXT_KEY,
    TRAIN_KEY,
)

REASONING_BLOCK = "<think>\n{}\n</think>\n"
"""How reasoning is written before the content for a chat template that does not render `reasoning_content`."""
SYSTEM_FIX = (
    "This template has no system role: drop the system turn, or set `data.system_prompt_merge=true` (it merges "
    "the system turn into the first user turn)."
)
GENERIC_FIX = (
    "Make the record's turns follow what the template expects (fix or drop the record), or use a tokenizer folder "
    "whose chat template accepts them."
)
PREFIX_FIX = (
    "the chat template does not render a conversation's first turns as the beginning of the whole, so prompt "
    "tokens cannot be told apart; set data.train_on=all or use another template."
)
REASONING_PREFIX_FIX = (
    " Templates like Qwen3's render an assistant turn's reasoning (or an empty <think> block) only after the last "
    "user turn, so an earlier turn renders differently once more turns follow: keep reasoning on the last "
    "assistant turn, or give each assistant turn its own record."
)


def template_refusal(where: str, messages: list[dict[str, Any]], err: Exception) -> RecordError:
    """The RecordError for a chat template that raised on a record: its message and the fix."""
    text = str(err) or type(err).__name__
    has_system = any(m["role"] == "system" for m in messages)
    system_case = has_system and any(word in text.lower() for word in ("alternate", "system"))
    return RecordError(
        f"{where}: the tokenizer's chat template refused the conversation ({type(err).__name__}: {text}). "
        f"{SYSTEM_FIX if system_case else GENERIC_FIX}"
    )


def _clean(messages: list[dict], *, reasoning: bool = True) -> list[dict]:
    """The messages as a chat template sees them: without our flags (and, `reasoning` false, without reasoning)."""
    drop = PRIVATE_KEYS if reasoning else (*PRIVATE_KEYS, REASONING_KEY)
    if not any(k in m for m in messages for k in drop):  # the common case: nothing to take out
        return messages
    return [{k: v for k, v in m.items() if k not in drop} for m in messages]


def _render(
    tokenizer: Tokenizer, conversation: Conversation, messages: list[dict], where: str, *, prompt: bool
) -> str:
    """`messages` rendered (with the conversation's tools); a template error as a RecordError."""
    try:
        return tokenizer.render_chat(_clean(messages), add_generation_prompt=prompt, tools=conversation.tools)
    except Exception as err:  # any failure of a user-supplied template is the record's problem
        raise template_refusal(where, conversation.messages, err) from err


def _check_tools_rendered(tokenizer: Tokenizer, conversation: Conversation, full: str, where: str) -> None:
    """Refuse tool specs or tool calls that the template would silently leave out of the text."""
    if not tokenizer.has_chat_template:
        raise RecordError(
            f"{where}: the record has tool specs or tool calls, but the tokenizer has no chat template and the "
            "built-in chat layout renders neither. Use `tokenizer=hf` with a tokenizer folder whose chat template "
            "renders tools (tools=..., assistant tool_calls), or drop the tool parts of the record."
        )
    if conversation.tools:
        bare = Conversation(conversation.messages, None)
        if _render(tokenizer, bare, conversation.messages, where, prompt=False) == full:
            raise RecordError(
                f"{where}: the record has 'tools' but the tokenizer's chat template does not render them (the text is "
                "the same without them). Use a tokenizer whose chat template renders tools, or drop 'tools'."
            )
    if any("tool_calls" in m for m in conversation.messages):
        plain = [{k: v for k, v in m.items() if k != "tool_calls"} for m in conversation.messages]
        if _render(tokenizer, conversation, plain, where, prompt=False) == full:
            raise RecordError(
                f"{where}: an assistant turn calls tools (tool_calls) but the tokenizer's chat template does not "
                "render tool calls. Use a tokenizer whose chat template renders them, or drop those turns."
            )


def _inline_reasoning(messages: list[dict]) -> list[dict]:
    """Messages whose reasoning is written before their content as REASONING_BLOCK (a span trained with the turn)."""
    out = []
    for m in messages:
        if REASONING_KEY not in m:
            out.append(m)
            continue
        block = m.get(THINK_TEXT_KEY) or REASONING_BLOCK.format(m[REASONING_KEY])
        spans = [(b + len(block), e + len(block), t) for b, e, t in m.get(SPANS_KEY, ())]
        bare = {k: v for k, v in m.items() if k not in (REASONING_KEY, THINK_TEXT_KEY)}
        out.append({**bare, "content": block + m["content"], SPANS_KEY: [(0, len(block), None), *spans],
                    THINK_KEY: len(block)})  # fmt: skip
    return out


@dataclass(frozen=True)
class _Rendered:
    """A conversation, its whole text, and what decides its mask."""

    tokenizer: Tokenizer
    conversation: Conversation
    messages: list[dict[str, Any]]
    full: str
    train_all: bool
    train_reasoning: str
    where: str

    def render(self, messages: list[dict], *, prompt: bool) -> str:
        """`messages` rendered with this conversation's tools."""
        return _render(self.tokenizer, self.conversation, messages, self.where, prompt=prompt)

    def unrendered(self, i: int, what: str) -> RecordError:
        """The refusal for reasoning (or spans) of turn `i` the template leaves out of the text."""
        return RecordError(
            f"{self.where}: turn {i} has {what}, but the chat template's text does not hold it as given (the template "
            "drops or rewrites it). "
            + (
                "Drop the turn's train_detail or part flags, or use a template that renders the content as it is."
                if what != "reasoning"
                else "data.train_reasoning=true trains every reasoning trace: set data.train_reasoning=auto to train "
                "what the template renders, or use a template that renders reasoning_content."
                if self.train_reasoning == "true"
                else "data.train_reasoning=false cannot find the trace to leave untrained: set "
                "data.train_reasoning=auto, or use a template that renders reasoning_content."
            )
        )


def _turn_range(r: _Rendered, i: int, done: int) -> tuple[int, int, str]:
    """(start, end, text through turn `i`): where turn `i` lies in the whole text (an assistant turn without its
    header), checked to begin the whole as a prefix."""
    prompt = r.render(r.messages[:i], prompt=r.messages[i]["role"] == "assistant") if i else ""
    through = r.render(r.messages[: i + 1], prompt=False)
    start, end = len(prompt), len(through)
    if not (r.full.startswith(prompt) and r.full.startswith(through)) or start < done or end < start:
        reasoning = any(REASONING_KEY in m or THINK_KEY in m for m in r.messages)
        raise RecordError(f"{r.where}: {PREFIX_FIX}{REASONING_PREFIX_FIX if reasoning else ''}")
    return start, end, through


def _reasoning_range(r: _Rendered, i: int, through: str) -> tuple[int, int] | None:
    """Where turn `i`'s reasoning lies in `through`: the characters it adds to the turn rendered without it."""
    bare = {k: v for k, v in r.messages[i].items() if k != REASONING_KEY}
    without = r.render([*r.messages[:i], bare], prompt=False)
    head = len(os.path.commonprefix([through, without]))
    tail = 0
    limit = min(len(through), len(without)) - head
    while tail < limit and through[-1 - tail] == without[-1 - tail]:
        tail += 1
    end = len(through) - tail
    return (head, end) if end > head else None


def _place_spans(r: _Rendered, i: int, lo: int, end: int, keep: bool, mask: bytearray) -> None:
    """Set the mask over turn `i`'s content spans, the content found in the text between `lo` and `end`."""
    m = r.messages[i]
    content, skip = m["content"], m.get(THINK_KEY, 0)
    at, first = r.full.find(content, lo, end), 0  # first: the first content character the text holds
    if at < 0 and skip:  # the template dropped the reasoning block written before the content
        rest = r.full.find(content[skip:], lo, end)
        if rest >= 0 and r.train_reasoning == "true":
            raise r.unrendered(i, "reasoning")
        if rest >= 0:
            at, first = rest - skip, skip
    if at + first < 0:
        own = any(trained is not None for _, _, trained in m[SPANS_KEY])
        raise r.unrendered(i, "train_detail or part train flags" if own else "reasoning")
    for begin, stop, trained in m[SPANS_KEY]:
        begin = max(begin, first)
        if stop > begin:
            mask[at + begin : at + stop] = bytes([keep if trained is None else trained]) * (stop - begin)


def _mark_turn(r: _Rendered, i: int, done: int, mask: bytearray) -> int:
    """Set the mask over turn `i` (its flag, reasoning and spans); the end of the turn in the text."""
    m = r.messages[i]
    flag = m.get(TRAIN_KEY, r.train_all or m["role"] == "assistant")
    start, end, through = _turn_range(r, i, done)
    mask[start:end] = bytes([flag]) * (end - start)
    keep, lo = flag and r.train_reasoning != "false", start
    if REASONING_KEY in m:  # the template renders reasoning_content
        found = _reasoning_range(r, i, through)
        if found is None or found[0] < start or found[1] > end:
            if r.train_reasoning == "true":
                raise r.unrendered(i, "reasoning")
        else:
            mask[found[0] : found[1]] = bytes([keep]) * (found[1] - found[0])
            lo = found[1]
    if m.get(SPANS_KEY):
        _place_spans(r, i, lo, end, keep, mask)
    return end


def _plain(r: _Rendered, m: dict) -> bool:
    """Whether a turn is trained as the text between turns is, with nothing inside it to mark."""
    flag = m.get(TRAIN_KEY, r.train_all or m["role"] == "assistant")
    own_spans = any(trained is not None for _, _, trained in m.get(SPANS_KEY, ()))
    reasoning = (REASONING_KEY in m or THINK_KEY in m) and (
        r.train_reasoning == "true" or (flag and r.train_reasoning == "false")
    )
    return flag == r.train_all and not own_spans and not reasoning


def conversation_segments(
    conversation: Conversation,
    tokenizer: Tokenizer,
    *,
    train_all: bool,
    where: str,
    train_reasoning: str = "auto",
) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) segments: assistant turns trained, the rest only with
    train_all; turns' own flags and spans, and their reasoning as data.train_reasoning says."""
    messages = conversation.messages
    full = _render(tokenizer, conversation, messages, where, prompt=False)
    if any(REASONING_KEY in m for m in messages):
        bare = _clean(messages, reasoning=False)  # the same text without it: the template has no notion of it
        if _render(tokenizer, conversation, bare, where, prompt=False) == full:
            messages = _inline_reasoning(messages)
            full = _render(tokenizer, conversation, messages, where, prompt=False)
    if conversation.uses_tools:
        _check_tools_rendered(tokenizer, Conversation(messages, conversation.tools), full, where)
    r = _Rendered(tokenizer, conversation, messages, full, train_all, train_reasoning, where)
    mask, done = bytearray([train_all]) * len(full), 0
    for i, message in enumerate(messages):
        if not _plain(r, message):
            done = _mark_turn(r, i, done, mask)
    runs = (match.span() for match in re.finditer(rb"\x00+|\x01+", bytes(mask)))
    return [(full[a:b], bool(mask[a])) for a, b in runs]
