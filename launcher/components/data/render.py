"""A conversation through the tokenizer's chat template, as text segments each trained or not.

Assistant turns (those that call tools included) are completions and are trained; system, user and
tool turns are prompt and are not, unless data.train_on=all. A template's own error (jinja2's
TemplateError from `raise_exception`, or anything else `apply_chat_template` raises) becomes a
RecordError naming the record, the template's message and the fix, so that it is refused before
launch (exit status 2) instead of escaping as a traceback.
"""

from __future__ import annotations

from typing import Any

from launcher.components.data.chat import Conversation
from launcher.components.data.sources import RecordError
from launcher.components.data.tokenizer import Tokenizer

SYSTEM_FIX = (
    "This template has no system role: drop the system turn, or set `data.system_prompt_merge=true` (it merges "
    "the system turn into the first user turn)."
)
GENERIC_FIX = (
    "Make the record's turns follow what the template expects (fix or drop the record), or use a tokenizer folder "
    "whose chat template accepts them."
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


def _render(
    tokenizer: Tokenizer, conversation: Conversation, messages: list[dict], where: str, *, prompt: bool
) -> str:
    """`messages` rendered (with the conversation's tools); a template error as a RecordError."""
    try:
        return tokenizer.render_chat(messages, add_generation_prompt=prompt, tools=conversation.tools)
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


def conversation_segments(
    conversation: Conversation, tokenizer: Tokenizer, *, train_all: bool, where: str
) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) segments: assistant turns trained, the rest only with train_all."""
    messages = conversation.messages
    full = _render(tokenizer, conversation, messages, where, prompt=False)
    if conversation.uses_tools:
        _check_tools_rendered(tokenizer, conversation, full, where)
    if train_all:
        return [(full, True)]
    segments, done = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, conversation, messages[:i], where, prompt=True) if i else ""
        through = _render(tokenizer, conversation, messages[: i + 1], where, prompt=False)
        start, end = len(prompt), len(through)
        if not (full.startswith(prompt) and full.startswith(through)) or start < done:
            raise RecordError(
                f"{where}: the chat template does not render a conversation's first turns as the beginning of the "
                "whole, so prompt tokens cannot be told apart; set data.train_on=all or use another template."
            )
        segments += [(full[done:start], False), (full[start:end], True)]
        done = end
    segments.append((full[done:], False))
    return [s for s in segments if s[0]]
