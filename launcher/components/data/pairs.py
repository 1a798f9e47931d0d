"""Preference data: a pair (data.format=preference) or a kto example (data.format=kto) as one document.

Layouts read (one record each):

- preference, strings: `prompt`, `chosen`, `rejected` text, joined as prompt + response;
- preference, messages (UltraFeedback-binarized, TRL's conversational layout): `chosen` and
  `rejected` are message lists, either whole conversations or the assistant turns that follow a
  `prompt` message list (a string `prompt` beside whole conversations is ignored: they hold it);
  rendered with the tokenizer's chat template, only assistant turns trained;
- preference, ShareGPT/LLaMA-Factory (`dpo_en_demo`): `conversations` ({from, value} turns, the
  shared conversation) and `chosen`, `rejected` as one {from, value} turn each (or a list of turns,
  or a string) that continue it; the record's `system` string and `tools` apply to both sides;
- kto: `prompt` and `completion` (strings or message lists as above) and a boolean `label`
  (true: desirable).

The token cache holds a pair as ONE document, chosen side then rejected side, so the train/val split
and every cut keep a pair whole; the REJECTED flag bit marks the rejected side's first token. A kto
example is one document, the UNDESIRABLE bit on its first token.
launcher.components.data.batching.PairDocuments reads them back as batches: [chosen rows; rejected rows] (kto: rows and `kto_label`). Truncation rule: each side keeps
its first data.seq_len + 1 tokens (the prompt first, so both sides of a pair lose the same prompt
tokens and then their responses' tails); a side cut inside its prompt trains nothing. A blank response
keeps no trained token, so such pairs, and pairs whose sides are the same, are counted before launch
and dropped or refused (launcher.components.data.pair_checks, launcher.front.pair_data).
"""

from __future__ import annotations

from typing import Any

from launcher.components.data.chat import chat_conversation, sharegpt_conversation
from launcher.components.data.render import conversation_segments
from launcher.components.data.sources import RecordError
from launcher.components.data.tokenizer import Tokenizer
from launcher.config.tokenizer import TokenizerConfig

TRAINED = 1
"""The token cache's TRAINED bit (launcher.components.data.tokens.TRAINED; a test holds them equal): encode_record's
flags are that bit, and the cache writes a record's flags as they are."""
REJECTED = 4
"""Flag bit: the first token of a pair's rejected side."""
UNDESIRABLE = 8
"""Flag bit: on the first token of a kto example labelled undesirable."""
PAIR_FORMATS = ("preference", "kto")
HINT = {
    "preference": "data.format=preference reads prompt + chosen + rejected (strings or message lists), or "
    "conversations + chosen + rejected (ShareGPT).",
    "kto": "data.format=kto reads prompt + completion (strings or message lists) + label (true: desirable).",
}


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) for m in value) and bool(value)


def _shared_turns(record: dict, key: str, fmt: str, where: str) -> dict:
    """A ShareGPT pair's side as a ShareGPT record: the shared `conversations` continued by the side's turn(s)
    (a {from, value} turn, a list of them, or a string), with the record's `system` and `tools`."""
    response = record.get(key)
    turns = [{"from": "gpt", "value": response}] if isinstance(response, str) else response
    turns = [turns] if isinstance(turns, dict) else turns
    if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) for t in turns):
        raise RecordError(
            f"{where}: '{key}' must be a {{from, value}} turn, a list of them, or a string. {HINT[fmt]}"
        )
    shared = record["conversations"]
    if not isinstance(shared, list):
        raise RecordError(f"{where}: 'conversations' must be a list of {{from, value}} turns. {HINT[fmt]}")
    return {"c": [*shared, *turns], **{k: record[k] for k in ("system", "tools") if k in record}}


def _side(
    record: dict, key: str, fmt: str, tokenizer: Tokenizer, where: str, reasoning: str
) -> list[tuple[str, bool]]:
    """One response of a record (with its prompt) as (text, trained) segments."""
    response, prompt = record.get(key), record.get("prompt")
    if "conversations" in record and fmt == "preference":
        conversation = sharegpt_conversation(_shared_turns(record, key, fmt, where), "c", where)
        return conversation_segments(
            conversation, tokenizer, train_all=False, where=where, train_reasoning=reasoning
        )
    if _is_messages(response):
        messages = response if response[0].get("role") != "assistant" else [*(prompt or []), *response]
        if response[0].get("role") == "assistant" and not _is_messages(prompt):
            raise RecordError(
                f"{where}: '{key}' holds assistant turns only, so 'prompt' must be a message list. {HINT[fmt]}"
            )
        conversation = chat_conversation({"m": messages, "tools": record.get("tools")}, "m", where)
        return conversation_segments(
            conversation, tokenizer, train_all=False, where=where, train_reasoning=reasoning
        )
    if not isinstance(response, str) or not isinstance(prompt, str):
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise RecordError(
            f"{where}: fields 'prompt' and '{key}' must be strings or message lists (the record's fields: {keys}). "
            f"{HINT[fmt]}"
        )
    return [(prompt, False), (response, True)]


def _blank(value: Any) -> bool:
    """Whether a response holds no text: a blank string, or turns whose assistant (gpt) contents are all blank."""
    if isinstance(value, str):
        return not value.strip()
    turns = [value] if isinstance(value, dict) else value if isinstance(value, list) else []
    texts = [
        t.get("content", t.get("value"))
        for t in turns
        if isinstance(t, dict) and t.get("role", t.get("from")) in ("assistant", "gpt")
    ]
    return bool(texts) and all(isinstance(text, str) and not text.strip() for text in texts)


def _encoded(
    segments: list[tuple[str, bool]], tok_cfg: TokenizerConfig, tokenizer: Tokenizer, *, blank: bool = False
) -> tuple[list[int], list[int]]:
    """A side's ids and flags; a blank response keeps no trained token (not even EOS), so the pair checks
    (launcher.components.data.pair_checks) see it as empty."""
    ids, trained = tokenizer.encode(segments)
    flags = [TRAINED if t and not blank else 0 for t in trained]
    if tok_cfg.add_bos and tokenizer.bos_id is not None:
        ids, flags = [tokenizer.bos_id, *ids], [0, *flags]
    if tok_cfg.add_eos and tokenizer.eos_id is not None:
        ids, flags = [*ids, tokenizer.eos_id], [*flags, 0 if blank else TRAINED]
    return ids, flags


def encode_pair(
    record: dict,
    fmt: str,
    tok_cfg: TokenizerConfig,
    tokenizer: Tokenizer,
    where: str,
    *,
    train_reasoning: str = "auto",
) -> tuple[list[int], list[int]]:
    """(token ids, flags) of a preference pair or a kto example as one document (the flags carry TRAINED and
    the REJECTED or UNDESIRABLE bit: the token cache keeps them as they are, TRAINED being bit 1)."""
    if fmt == "kto":
        label = record.get("label")
        if not isinstance(label, bool):
            raise RecordError(f"{where}: 'label' must be true or false, got {label!r}. {HINT[fmt]}")
        ids, flags = _encoded(
            _side(record, "completion", fmt, tokenizer, where, train_reasoning),
            tok_cfg,
            tokenizer,
            blank=_blank(record.get("completion")),
        )
        if ids and not label:
            flags[0] |= UNDESIRABLE
        return ids, flags
    chosen, chosen_flags, rejected, rejected_flags = (
        part
        for key in ("chosen", "rejected")
        for part in _encoded(
            _side(record, key, fmt, tokenizer, where, train_reasoning),
            tok_cfg,
            tokenizer,
            blank=_blank(record.get(key)),
        )
    )
    if not chosen or not rejected:
        raise RecordError(f"{where}: a pair needs a non-empty chosen and rejected side. {HINT[fmt]}")
    rejected_flags[0] |= REJECTED
    return chosen + rejected, chosen_flags + rejected_flags
