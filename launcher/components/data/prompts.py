"""Prompts as data (data.format=prompt): the records online RL samples its completions from.

A record holds `prompt`, a string or a message list, or `messages`, a message list (TRL's
conversational layout); a message list is rendered with the tokenizer's chat template (the built-in
layout for tokenizers without one) ending in the assistant's generation prompt, as SFT renders a
conversation's prompt turns. Every other field of the record (`answer`, `solution`, ...) is kept as it
is and handed to the reward functions beside the prompt and its completions.

Prompts are few and short, so they are not kept in the token cache: a rank reads and encodes them
all when it starts (`read_prompts`), and the launching process does the same once before launch to
count them and to refuse a prompt longer than data.seq_len - objective.max_completion_length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.components.data.sources import RecordError, records
from launcher.components.data.tokenizer import Tokenizer
from launcher.config.data import DataConfig
from launcher.config.tokenizer import TokenizerConfig

PROMPT_FIELDS = ("prompt", "messages")
"""The fields a prompt is read from, in this order."""
HINT = (
    "data.format=prompt reads `prompt` (a string or a list of {role, content} messages) or `messages` "
    "(a message list); the record's other fields go to the reward functions."
)


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """One prompt record, encoded: what the policy continues and what its rewards read."""

    ids: tuple[int, ...]
    """The prompt's token ids (bos first where tokenizer.add_bos; a chat prompt ends in the generation prompt)."""
    text: str
    """The prompt as the reward functions see it (a chat prompt: the rendered text)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """The record's other fields (e.g. `answer`), passed to the rewards as they are."""


def _messages(value: Any, key: str, where: str) -> list[dict[str, Any]]:
    """A message list, checked: {role, content} dicts with string contents."""
    ok = isinstance(value, list) and value and all(isinstance(m, dict) for m in value)
    if not ok or not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
        raise RecordError(f"{where}: '{key}' must be a non-empty list of {{role, content}} messages. {HINT}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def prompt_text(record: Any, tokenizer: Tokenizer, where: str) -> tuple[str, dict[str, Any]]:
    """(the prompt's text, the record's other fields) of one prompt record, or a RecordError naming it."""
    if not isinstance(record, dict):
        raise RecordError(f"{where}: a record must be a JSON object, not {type(record).__name__}. {HINT}")
    key = next((k for k in PROMPT_FIELDS if k in record), None)
    if key is None:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise RecordError(f"{where}: no field 'prompt' or 'messages' (the record's fields: {keys}). {HINT}")
    value = record[key]
    fields = {k: v for k, v in record.items() if k != key}
    if isinstance(value, str):
        if not value:
            raise RecordError(f"{where}: '{key}' is empty; a prompt needs at least one token. {HINT}")
        return value, fields
    messages = _messages(value, key, where)
    return tokenizer.render_chat(messages, add_generation_prompt=True), fields


def encode_prompt(
    record: Any, tok_cfg: TokenizerConfig, tokenizer: Tokenizer, where: str
) -> tuple[list[int], list[bool]]:
    """(token ids, trained flags: none) of a prompt record, as encode_record gives every format's."""
    text, _ = prompt_text(record, tokenizer, where)
    ids, _ = tokenizer.encode([(text, False)])
    if tok_cfg.add_bos and tokenizer.bos_id is not None:
        ids = [tokenizer.bos_id, *ids]
    return ids, [False] * len(ids)


def read_prompts(
    cfg: DataConfig, tok_cfg: TokenizerConfig, tokenizer: Tokenizer, cache_dir: Path
) -> list[tuple[str, Prompt]]:
    """(where, Prompt) of every record of data.path (data.val_path's are not read: the prompts train), in file order."""
    found = []
    for _, where, record in records(cfg, cfg.path, cache_dir):
        text, fields = prompt_text(record, tokenizer, where)
        ids, _ = encode_prompt(record, tok_cfg, tokenizer, where)
        found.append((where, Prompt(ids=tuple(ids), text=text, fields=fields)))
    return found


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """A completion's text: bytes as UTF-8 (broken sequences replaced), a folder's ids through transformers."""
    inner = getattr(tokenizer, "tok", None)
    if inner is None:
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")
    return inner.decode(ids, skip_special_tokens=True)
