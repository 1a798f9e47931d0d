"""Conversations: `chat` (OpenAI-style messages) and `sharegpt` (from/value turns) records as checked messages.

Both layouts end as one `Conversation`: messages of {role, content} (plus `tool_calls` on assistant
turns, OpenAI's legacy `function_call` read as one; `name`/`tool_call_id` on tool turns, `role: function`
read as a tool turn), each turn's own training flags and reasoning (turns.py), and the record's tool
specs, ready for a chat template (`launcher/components/data/render.py` renders and masks them). Content
given as a list of parts keeps its text parts, joined with PART_SEPARATOR, and its reasoning parts; any
other part is refused with the record and the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from launcher.components.data.sources import RecordError
from launcher.components.data.turns import REASONING_PARTS, SPANS_KEY, part_reasoning, turn_extras
from launcher.config.tokenizer import CHAT_ROLES

PART_SEPARATOR = "\n"
"""Between the text parts of one message's content (as vLLM's OpenAI server joins them for text-only templates)."""
SYSTEM_MERGE_SEPARATOR = "\n\n"
"""Between a merged system turn and the first user turn's content (data.system_prompt_merge)."""
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "function_call": "assistant",
}
"""ShareGPT's `from` values -> chat roles; `function_call` becomes an assistant turn carrying tool calls."""


@dataclass(frozen=True)
class Conversation:
    """One record's messages, checked and normalized, and its tool specs (None: the record has none)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None

    @property
    def uses_tools(self) -> bool:
        """Whether the record carries tool specs or assistant tool calls (a template must render them)."""
        return bool(self.tools) or any("tool_calls" in m for m in self.messages)


def _content(content: Any, where: str) -> tuple[str, list[tuple[int, int, bool]], list[str]]:
    """(text, spans of parts with their own `train` flag, reasoning parts' texts) of a message's content.

    A string is the text as is; a list of parts gives its text parts joined with PART_SEPARATOR.
    """
    if isinstance(content, str):
        return content, [], []
    if not isinstance(content, list):
        raise RecordError(
            f"{where} is {type(content).__name__}, not a string or a list of text parts (set data.field)."
        )
    texts: list[str] = []
    spans: list[tuple[int, int, bool]] = []
    reasoning: list[str] = []
    offset = 0
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in REASONING_PARTS:
            reasoning.append(part_reasoning(part, kind, f"{where}[{j}]"))
            continue
        if kind == "text" and isinstance(part.get("text"), str):
            offset += len(PART_SEPARATOR) if texts else 0
            texts.append(part["text"])
            if part.get("train") is not None:
                if not isinstance(part["train"], bool):
                    raise RecordError(f"{where}[{j}].train is {part['train']!r}; it takes true or false.")
                spans.append((offset, offset + len(part["text"]), part["train"]))
            offset += len(part["text"])
        elif kind in (None, "text"):
            raise RecordError(
                f"{where}[{j}] is not a text part ({{'type': 'text', 'text': '...'}}); got {str(part)[:80]}."
            )
        else:
            raise RecordError(
                f"{where}[{j}] is a '{kind}' part: the launcher trains text-only models, so only 'text' and "
                "'reasoning' parts are read. Drop the part (or the record)."
            )
    return PART_SEPARATOR.join(texts), spans, reasoning


def _arguments(value: Any, where: str) -> dict[str, Any]:
    """Tool-call arguments as a dict (a JSON string holding an object is parsed, as chat templates expect dicts)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as err:
            raise RecordError(f"{where} is a string that is not JSON ({err.msg}).") from err
    if not isinstance(value, dict):
        raise RecordError(f"{where} must be an object of argument values, not {type(value).__name__}.")
    return value


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """One tool call as {type: function, function: {name, arguments}} (the flat {name, arguments} form accepted)."""
    if not isinstance(call, dict):
        raise RecordError(
            f"{where} is {type(call).__name__}, not a {{function: {{name, arguments}}}} object."
        )
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RecordError(f"{where} has no function name (expected {{function: {{name, arguments}}}}).")
    normalized: dict[str, Any] = {
        "type": "function",
        "function": {
            "name": function["name"],
            "arguments": _arguments(function.get("arguments", {}), f"{where}.function.arguments"),
        },
    }
    if isinstance(call.get("id"), str):
        normalized["id"] = call["id"]
    return normalized


def tool_specs(value: Any, where: str) -> list[dict[str, Any]] | None:
    """A record's `tools`: a list of JSON-schema function specs (or that list as a JSON string); None when absent."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise RecordError(f"{where}: 'tools' is a string that is not JSON ({err.msg}).") from err
    if not isinstance(value, list):
        raise RecordError(f"{where}: 'tools' must be a list of function specs, not {type(value).__name__}.")
    for i, spec in enumerate(value):
        function = spec.get("function", spec) if isinstance(spec, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RecordError(
                f"{where}: tools[{i}] is not a function spec ({{type: function, function: {{name, description, "
                "parameters}}}})."
            )
    return value


def _role(message: dict, i: int, name: str, where: str) -> str:
    """A message's chat role (OpenAI's legacy `function` result turn is a tool turn), or a RecordError."""
    role = message.get("role")
    if role == "function":
        return "tool"
    if role not in CHAT_ROLES:
        layout = (
            " The turns have ShareGPT's from/value layout: set data.format=sharegpt."
            if "from" in message
            else ""
        )
        raise RecordError(
            f"{where}: {name}[{i}] has role {role!r}; known roles: {', '.join(CHAT_ROLES)}.{layout}"
        )
    return role


def _calls(message: dict, role: str, at: str) -> list[dict[str, Any]] | None:
    """A turn's tool calls: `tool_calls`, or OpenAI's legacy `function_call` {name, arguments} as one call."""
    calls, legacy = message.get("tool_calls"), message.get("function_call")
    if (calls is not None or legacy is not None) and role != "assistant":
        key = "tool_calls" if calls is not None else "function_call"
        raise RecordError(f"{at} carries {key} but has role {role!r}; only assistant turns call tools.")
    if calls is None and legacy is not None:
        return [_tool_call(legacy, f"{at}.function_call")]
    if not calls:
        return None
    if not isinstance(calls, list):
        raise RecordError(f"{at}.tool_calls must be a list of tool calls.")
    return [_tool_call(c, f"{at}.tool_calls[{j}]") for j, c in enumerate(calls)]


def _message(message: Any, i: int, name: str, where: str) -> dict[str, Any]:
    """Message `i` of a chat record checked and normalized: role, text content, tool calls, flags, reasoning."""
    hint = f"data.format=chat reads a list of {{role, content}} under '{name}' (set data.field to its field)"
    if not isinstance(message, dict):
        raise RecordError(
            f"{where}: {name}[{i}] is {type(message).__name__}, not a {{role, content}} dict. {hint}."
        )
    at = f"{where}: {name}[{i}]"
    role = _role(message, i, name, where)
    calls = _calls(message, role, at)
    content = message.get("content")
    if content is None and (
        calls or any(message.get(k) is not None for k in ("reasoning_content", "reasoning"))
    ):
        content = ""  # OpenAI's layout: a turn that only calls tools (or only reasons) has null content
    if not isinstance(content, str | list):
        raise RecordError(f"{at}.content is {type(content).__name__}, not a string. {hint}.")
    text, spans, reasoning = _content(content, f"{at}.content")
    text, extras = turn_extras(message, role, text, spans, reasoning, at)
    out: dict[str, Any] = {"role": role, "content": text, **extras}
    if calls:
        out["tool_calls"] = calls
    if role == "tool":
        out.update({k: message[k] for k in ("name", "tool_call_id") if isinstance(message.get(k), str)})
    return out


def chat_conversation(record: dict, name: str, where: str) -> Conversation:
    """The conversation of a chat record (`name`: its field), or a RecordError naming what is wrong."""
    messages = record[name]
    if not isinstance(messages, list) or not messages:
        kind = "empty" if isinstance(messages, list) else type(messages).__name__
        raise RecordError(
            f"{where}: '{name}' is {kind}, not a list of messages. data.format=chat reads a list of "
            f"{{role, content}} under '{name}' (set data.field to its field)."
        )
    checked = [_message(m, i, name, where) for i, m in enumerate(messages)]
    return Conversation(checked, tool_specs(record.get("tools"), where))


def _function_call(value: str, where: str) -> list[dict[str, Any]]:
    """A ShareGPT `function_call` turn's value: a JSON {name, arguments} object, or a list of them."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as err:
        raise RecordError(
            f'{where}: a function_call turn holds a tool call as JSON ({{"name": ..., "arguments": ...}}); '
            f"this one is not JSON ({err.msg})."
        ) from err
    calls = parsed if isinstance(parsed, list) else [parsed]
    return [_tool_call(c, f"{where} (function_call)") for c in calls]


def sharegpt_conversation(record: dict, name: str, where: str) -> Conversation:
    """The conversation of a ShareGPT record: `from`/`value` turns, an optional `system` string and `tools`."""
    turns = record[name]
    hint = f"data.format=sharegpt reads a list of {{from, value}} turns under '{name}' (set data.field to its field)"
    if not isinstance(turns, list) or not turns:
        kind = "empty" if isinstance(turns, list) else type(turns).__name__
        raise RecordError(f"{where}: '{name}' is {kind}, not a list of turns. {hint}.")
    messages: list[dict[str, Any]] = []
    system = record.get("system")
    if isinstance(system, str) and system:
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn:
            layout = (
                " It has role/content: set data.format=chat."
                if isinstance(turn, dict) and "role" in turn
                else ""
            )
            raise RecordError(f"{where}: {name}[{i}] is not a {{from, value}} turn. {hint}.{layout}")
        source, value = turn["from"], turn.get("value")
        if source not in SHAREGPT_ROLES:
            raise RecordError(
                f"{where}: {name}[{i}] comes from {source!r}; known: {', '.join(SHAREGPT_ROLES)}."
            )
        if not isinstance(value, str):
            raise RecordError(f"{where}: {name}[{i}].value is {type(value).__name__}, not a string. {hint}.")
        if source == "function_call":
            calls = _function_call(value, f"{where}: {name}[{i}]")
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        else:
            role = SHAREGPT_ROLES[source]
            value, extras = turn_extras(turn, role, value, [], [], f"{where}: {name}[{i}]")
            messages.append({"role": role, "content": value, **extras})
    return Conversation(messages, tool_specs(record.get("tools"), where))


def merge_system(conversation: Conversation, where: str) -> Conversation:
    """The leading system turn(s) folded into the first user turn (for chat templates with no system role)."""
    messages = conversation.messages
    count = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if count == 0:
        return conversation
    if count == len(messages) or messages[count]["role"] != "user":
        raise RecordError(
            f"{where}: data.system_prompt_merge=true merges the system turn into the first user turn, but no user "
            "turn follows it. Fix the record or drop it."
        )
    system = SYSTEM_MERGE_SEPARATOR.join(m["content"] for m in messages[:count] if m["content"])
    first = messages[count]
    head = f"{system}{SYSTEM_MERGE_SEPARATOR}" if system else ""
    merged = {**first, "content": f"{head}{first['content']}"}
    if SPANS_KEY in first:  # the user turn's spans move with its content
        merged[SPANS_KEY] = [(b + len(head), e + len(head), t) for b, e, t in first[SPANS_KEY]]
    return Conversation([merged, *messages[count + 1 :]], conversation.tools)
