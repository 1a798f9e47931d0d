"""Record formats: how one record becomes token ids and per-token trained flags.

- text: `data.field` holds a document; every token is trained.
- instruction: the alpaca layout (`instruction`, `input`, `output`), rendered with
  INSTRUCTION_TEMPLATE (or `data.template`); the prompt is not trained unless data.train_on=all.
- chat: `data.field` (default `messages`) holds `{role, content}` dicts (content: a string or text
  parts; assistant `tool_calls`, `tool` turns, the record's `tools`), rendered with the tokenizer's
  chat template; only assistant turns are trained unless data.train_on=all or a turn's own flag says
  otherwise, reasoning as data.train_reasoning says (chat.py, turns.py, render.py).
- sharegpt: `data.field` (default `conversations`) holds `{from, value}` turns, read as chat.
- pretokenized: `data.field` (default `input_ids`) holds token ids, optional `labels` (-100 = not trained).
- preference, kto: pairs.py. A preference pair read as chat or sharegpt is refused (it would drop both responses).
- prompt: prompts.py, the prompts online RL samples from (nothing trained: the completions are the policy's).

Every problem is a RecordError naming the record (`where`), the key and the fix.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING, Any

from launcher.components.data.chat import chat_conversation, merge_system, sharegpt_conversation
from launcher.components.data.layouts import DEFAULT_FIELDS, choices, matches, reason, whole_conversations
from launcher.components.data.render import conversation_segments
from launcher.components.data.sources import RecordError
from launcher.components.data.tokenizer import Tokenizer
from launcher.config.data import DataConfig
from launcher.config.tokenizer import TokenizerConfig

if TYPE_CHECKING:  # numpy only where records are encoded in batches (not in the checks before launch)
    import numpy as np

INSTRUCTION_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
"""The alpaca prompt for a record with an input."""
INSTRUCTION_TEMPLATE_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"
"""The alpaca prompt for a record whose input is empty."""
TEMPLATE_FIELDS = frozenset({"instruction", "input"})


def field_of(cfg: DataConfig) -> str:
    """The record field the format reads: data.field, or the format's usual one when data.field is left at `text`."""
    return DEFAULT_FIELDS[cfg.format] if cfg.field == "text" else cfg.field


def template_problem(template: str | None) -> str | None:
    """Why `data.template` cannot render an instruction prompt, or None."""
    if template is None:
        return None
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        return f"data.template is not a valid format string ({err}); write braces as {{{{ and }}}}"
    unknown = names - TEMPLATE_FIELDS
    if unknown:
        return f"data.template names {sorted(unknown)}; it may name only {{instruction}} and {{input}}"
    if "instruction" not in names:
        return "data.template never places {instruction}"
    return None


def _text(record: dict, name: str, where: str, hint: str, *, suggest: bool = False) -> str:
    """The string field `name` of a record; `suggest`: name the format the record's fields look like."""
    value = record.get(name)
    if not isinstance(value, str):
        found = "is missing" if name not in record else f"is {type(value).__name__}, not a string"
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise RecordError(
            f"{where}: field '{name}' {found} (the record's fields: {keys}). {(suggest and _layout_hint(record)) or hint}"
        )
    return value


PAIR_FIX = (
    "train it with a preference objective, which reads both sides: objective=dpo (or simpo, orpo) with "
    "data.format=preference, or objective=kto with data.format=kto for kto examples (docs/preference.md)"
)


def _layout_hint(record: dict) -> str | None:
    """The format a record's fields suggest, when they suggest one (several: the choices, a pair: its objective)."""
    found = matches(record)
    if len(found) > 1:
        return f"The record fits several layouts: set {choices(found)}."
    if not found or found[0][0] == "text":
        return None
    fmt, name = found[0]
    if fmt in ("preference", "kto"):
        return f"The record is a {'preference pair' if fmt == 'preference' else 'kto example'}: {PAIR_FIX}."
    if fmt == "instruction":
        return "The record has the alpaca layout: add data.format=instruction (or data.format=auto)."
    field = "" if DEFAULT_FIELDS[fmt] == name else f" data.field={name}"
    return f"The record has the {fmt} layout ({reason(fmt, name)}): add data.format={fmt}{field} (or data.format=auto)."


def _refuse_pairs(record: dict, cfg: DataConfig, name: str, where: str) -> None:
    """A preference pair read as its shared conversation would train the prompt and drop both responses: refuse it
    (a whole conversation beside the pair, UltraFeedback's `messages`, is fine-tuned on as asked)."""
    whole = [field for _, field in whole_conversations(record)]
    if name in ("chosen", "rejected", *whole) or matches(record)[:1] != [("preference", "chosen")]:
        return
    raise RecordError(
        f"{where}: the record is a preference pair (chosen and rejected): data.format={cfg.format} would train "
        f"'{name}' alone and drop both responses. {PAIR_FIX[0].upper()}{PAIR_FIX[1:]}."
    )


def _instruction(record: dict, cfg: DataConfig, where: str) -> list[tuple[str, bool]]:
    hint = "data.format=instruction reads the alpaca layout: instruction, input (may be empty), output."
    instruction = _text(record, "instruction", where, hint)
    output = _text(record, "output", where, hint)
    given = record.get("input", "")
    if given is None:
        given = ""
    if not isinstance(given, str):
        raise RecordError(f"{where}: field 'input' is {type(given).__name__}, not a string. {hint}")
    template = cfg.template or (INSTRUCTION_TEMPLATE if given else INSTRUCTION_TEMPLATE_NO_INPUT)
    prompt = template.format(instruction=instruction, input=given)
    return [(prompt, cfg.train_on == "all"), (output, True)]


def _conversation(record: dict, cfg: DataConfig, tokenizer: Tokenizer, where: str) -> list[tuple[str, bool]]:
    """A chat or sharegpt record as rendered segments, prompt turns untrained unless data.train_on=all."""
    name = field_of(cfg)
    if name not in record:
        keys = ", ".join(sorted(map(str, record))) or "none"
        hint = _layout_hint(record) or "Set data.field to the field that holds the conversation."
        raise RecordError(f"{where}: no field '{name}' (the record's fields: {keys}). {hint}")
    _refuse_pairs(record, cfg, name, where)
    read = sharegpt_conversation if cfg.format == "sharegpt" else chat_conversation
    conversation = read(record, name, where)
    if cfg.system_prompt_merge:
        conversation = merge_system(conversation, where)
    return conversation_segments(
        conversation,
        tokenizer,
        train_all=cfg.train_on == "all",
        where=where,
        train_reasoning=cfg.train_reasoning,
    )


def _pretokenized(record: dict, cfg: DataConfig, vocab_size: int, where: str) -> tuple[list[int], list[bool]]:
    name = field_of(cfg)
    ids = record.get(name)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RecordError(
            f"{where}: '{name}' must be a list of integer token ids (set data.field to that field)."
        )
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RecordError(
            f"{where}: token id {bad} in '{name}' lies outside the tokenizer's {vocab_size} ids."
        )
    labels = record.get("labels")
    if labels is None:
        return list(ids), [True] * len(ids)
    if not isinstance(labels, list) or len(labels) != len(ids):
        raise RecordError(f"{where}: 'labels' must be a list as long as '{name}' ({len(ids)}).")
    if any(label not in (-100, token) for label, token in zip(labels, ids, strict=True)):
        raise RecordError(
            f"{where}: 'labels' may hold only the token id at its position or -100 (not trained)."
        )
    return list(ids), [label != -100 for label in labels]


def _segments(record: Any, cfg: DataConfig, tokenizer: Tokenizer, where: str) -> list[tuple[str, bool]]:
    """The record's text segments, each trained or not (any format but pretokenized)."""
    if cfg.format in ("chat", "sharegpt"):
        return _conversation(record, cfg, tokenizer, where)
    if cfg.format == "auto":  # front/data_format.py resolves it before the checks; this is a last guard
        raise RecordError(
            f"{where}: data.format=auto found no records to choose a format from; set data.format."
        )
    if cfg.format == "instruction":
        return _instruction(record, cfg, where)
    hint = "Set data.field to the field that holds the text."
    return [(_text(record, field_of(cfg), where, hint, suggest=True), True)]


def _checked(record: Any, where: str) -> dict:
    if not isinstance(record, dict):
        raise RecordError(f"{where}: a record must be a JSON object, not {type(record).__name__}.")
    return record


def _specials(
    cfg: DataConfig, tok_cfg: TokenizerConfig, tokenizer: Tokenizer
) -> tuple[int | None, int | None]:
    """(bos, eos) ids to put around a text or instruction document (None: not added); chat templates write their own."""
    if cfg.format in ("chat", "sharegpt"):
        return None, None
    bos = tokenizer.bos_id if tok_cfg.add_bos else None
    return bos, tokenizer.eos_id if tok_cfg.add_eos else None


def encode_record(
    record: Any, cfg: DataConfig, tok_cfg: TokenizerConfig, tokenizer: Tokenizer, where: str
) -> tuple[list[int], list[bool]]:
    """(token ids, trained flags) of one record in the configured format, bos/eos added as configured."""
    record = _checked(record, where)
    if cfg.format == "pretokenized":
        return _pretokenized(record, cfg, tokenizer.vocab_size, where)
    if cfg.format == "prompt":
        from launcher.components.data.prompts import encode_prompt

        return encode_prompt(record, tok_cfg, tokenizer, where)
    if cfg.format in ("preference", "kto"):
        from launcher.components.data.pairs import encode_pair

        return encode_pair(  # flags: ints with the pair's bits
            record, cfg.format, tok_cfg, tokenizer, where, train_reasoning=cfg.train_reasoning
        )
    ids, trained = tokenizer.encode(_segments(record, cfg, tokenizer, where))
    bos, eos = _specials(cfg, tok_cfg, tokenizer)
    if bos is not None:
        ids, trained = [bos, *ids], [False, *trained]
    if eos is not None:
        ids, trained = [*ids, eos], [*trained, True]
    return ids, trained


def encode_records(
    items: list[tuple[str, Any]], cfg: DataConfig, tok_cfg: TokenizerConfig, tokenizer: Tokenizer
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`encode_record` of each (where, record) as (ids, trained) arrays, the texts encoded in one tokenizer call."""
    import numpy as np

    if cfg.format == "pretokenized":
        pairs = [
            _pretokenized(_checked(record, where), cfg, tokenizer.vocab_size, where)
            for where, record in items
        ]
        return [(np.asarray(ids, dtype=np.int64), np.asarray(flags, dtype=bool)) for ids, flags in pairs]
    if cfg.format in ("preference", "kto"):  # a pair's sides are encoded one record at a time, its bits kept
        pairs = [encode_record(record, cfg, tok_cfg, tokenizer, where) for where, record in items]
        return [(np.asarray(ids, dtype=np.int64), np.asarray(flags, dtype=np.uint8)) for ids, flags in pairs]
    encoded = tokenizer.encode_batch(
        [_segments(_checked(record, where), cfg, tokenizer, where) for where, record in items]
    )
    bos, eos = _specials(cfg, tok_cfg, tokenizer)
    if bos is None and eos is None:
        return encoded
    head = np.array([] if bos is None else [bos], dtype=np.int64)
    tail = np.array([] if eos is None else [eos], dtype=np.int64)
    head_flags, tail_flags = np.zeros(len(head), dtype=bool), np.ones(len(tail), dtype=bool)
    return [
        (np.concatenate([head, ids, tail]), np.concatenate([head_flags, flags, tail_flags]))
        for ids, flags in encoded
    ]
