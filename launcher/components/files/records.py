"""Reading back the small JSON records the launcher writes, defensively: structure, types and ranges checked.

Each reader returns the record as the launcher wrote it, or raises DamagedFile (a RefusedFile) naming the file, what
is wrong and what to do. A record is never used half-read: a field of the wrong type, a negative
size or a number that is not finite refuses the whole file. The callers decide what a refusal means
(docs/reliability.md, "Our own files read back"): the token cache's meta stops the run, a stale
advisor or micro-batch record is named on the console and replaced, a sweep point is shown as
unreadable.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from launcher.components.files.safe_load import RefusedFile


class DamagedFile(RefusedFile):
    """A file the launcher wrote that does not read back as written (damaged, cut short, from another version)."""

    def __init__(
        self, path: Path | str, reason: str, names_code: bool = False, advice: str | None = None
    ) -> None:
        super().__init__(path, reason, names_code, advice)
        if not names_code:  # RefusedFile's wording is about code; this file holds none
            self.args = (
                f"{path} does not read back as the launcher wrote it: {reason}. {advice or ''}".strip(),
            )


ADVICE_STATE_ADVICE = (
    "The advisor ignores it (no learning-rate advice for a batch change this session) and this session's "
    "global batch and learning rate replace it."
)
MICRO_BATCH_ADVICE = "The micro-batch search runs again and its choice replaces the file."
SWEEP_ADVICE = "The point is shown as unreadable; run it again (or delete that file) to get a fresh record."


def read_json_object(path: Path, advice: str) -> dict[str, Any]:
    """The JSON object in `path`; DamagedFile when it is unreadable, not JSON or not an object."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise DamagedFile(path, "it is not UTF-8 text", False, advice) from None
    except OSError as err:
        raise DamagedFile(path, f"it cannot be read: {err.strerror or err}", False, advice) from None
    try:
        value = json.loads(text)
    except ValueError as err:
        reason = "it is empty" if not text.strip() else f"it is not JSON ({err})"
        raise DamagedFile(path, reason, False, advice) from None
    if not isinstance(value, dict):
        raise DamagedFile(path, f"it holds a JSON {_kind(value)}, not an object", False, advice)
    return value


def _kind(value: object) -> str:
    """A JSON value's type in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def count(record: dict[str, Any], key: str, path: Path, advice: str, *, minimum: int = 0) -> int:
    """record[key] as an integer of at least `minimum` (a bool is no integer); DamagedFile otherwise."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DamagedFile(path, f"{key} is {_shown(value)}, not an integer", False, advice)
    if value < minimum:
        raise DamagedFile(path, f"{key} is {value}, below {minimum}", False, advice)
    return value


def number(record: dict[str, Any], key: str, path: Path, advice: str, *, positive: bool = False) -> float:
    """record[key] as a finite number (positive if asked); DamagedFile otherwise."""
    value = _numeric(record, key, path, advice)
    if not math.isfinite(value) or (positive and value <= 0):
        raise DamagedFile(
            path, f"{key} is {value}, not a {'positive ' * positive}finite number", False, advice
        )
    return float(value)


def optional_number(record: dict[str, Any], key: str, path: Path, advice: str) -> float | None:
    """record[key] as a number (a failed run's loss may be inf or NaN, as JSON writes them), or None where absent."""
    return None if record.get(key) is None else float(_numeric(record, key, path, advice))


def _numeric(record: dict[str, Any], key: str, path: Path, advice: str) -> int | float:
    """record[key] if it is a JSON number (a bool is none); DamagedFile otherwise."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DamagedFile(path, f"{key} is {_shown(value)}, not a number", False, advice)
    return value


def text(record: dict[str, Any], key: str, path: Path, advice: str) -> str:
    """record[key] as a string; DamagedFile otherwise."""
    value = record.get(key)
    if not isinstance(value, str):
        raise DamagedFile(path, f"{key} is {_shown(value)}, not a string", False, advice)
    return value


def _shown(value: object) -> str:
    """A field's value for a message: absent, or its JSON type and a short repr."""
    if value is None:
        return "missing or null"
    shown = repr(value)
    return f"{_kind(value)} {shown[:40] + '...' if len(shown) > 40 else shown}"


def read_advice_state(path: Path) -> dict[str, Any]:
    """advice_state.json: {"global_batch": int >= 1, "lr": finite number > 0}."""
    record = read_json_object(path, ADVICE_STATE_ADVICE)
    return {
        "global_batch": count(record, "global_batch", path, ADVICE_STATE_ADVICE, minimum=1),
        "lr": number(record, "lr", path, ADVICE_STATE_ADVICE, positive=True),
    }


def read_micro_batch(path: Path) -> dict[str, Any]:
    """auto_micro_batch.json: its key (the search's inputs) and a micro batch that divides the per-rank batch."""
    record = read_json_object(path, MICRO_BATCH_ADVICE)
    key = record.get("key")
    if not isinstance(key, dict):
        raise DamagedFile(path, f"key is {_shown(key)}, not an object", False, MICRO_BATCH_ADVICE)
    per_rank = count(key, "per_rank_batch", path, MICRO_BATCH_ADVICE, minimum=1)
    size = count(record, "micro_batch_size", path, MICRO_BATCH_ADVICE, minimum=1)
    if per_rank % size:
        raise DamagedFile(
            path,
            f"micro_batch_size {size} does not divide the per-rank batch {per_rank}",
            False,
            MICRO_BATCH_ADVICE,
        )
    return {**record, "micro_batch_size": size}


def read_sweep_point(path: Path) -> dict[str, Any]:
    """sweep_point.json: {"num": int >= 0, "overrides": [str, ...]}."""
    record = read_json_object(path, SWEEP_ADVICE)
    overrides = record.get("overrides")
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise DamagedFile(
            path, f"overrides is {_shown(overrides)}, not a list of strings", False, SWEEP_ADVICE
        )
    return {"num": count(record, "num", path, SWEEP_ADVICE), "overrides": overrides}


def read_summary(path: Path) -> dict[str, Any]:
    """A run's summary.json, the fields a sweep table reads: exit_reason, steps, final_loss, eval_loss."""
    record = read_json_object(path, SWEEP_ADVICE)
    steps = record.get("steps")
    return {
        **record,
        "exit_reason": text(record, "exit_reason", path, SWEEP_ADVICE),
        "steps": None if steps is None else count(record, "steps", path, SWEEP_ADVICE),
        "final_loss": optional_number(record, "final_loss", path, SWEEP_ADVICE),
        "eval_loss": optional_number(record, "eval_loss", path, SWEEP_ADVICE),
    }
