"""`train-generate --prompts FILE`: the JSONL file of prompts read in, and the JSONL of completions written out.

One JSON object per line with a "prompt" string (other fields are kept out of the way, not read);
blank lines are skipped. A line that is not such an object is refused with the file and line named,
before the model loads. Each completion is one JSON object per line, in the prompts' order: the
prompt, the completion's text, its token ids and why it stopped ("eos" or "max_new_tokens").
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from launcher.tools.hf_folder import ExportError

EXAMPLE = '{"prompt": "def main("}'
"""A well-formed line, quoted by the refusals."""


def _line_problem(line: str) -> str | None:
    """What is wrong with one non-blank line of a prompts file, or None."""
    try:
        record = json.loads(line)
    except ValueError as err:
        return f"is not JSON ({err})"
    if not isinstance(record, dict):
        return f"holds a JSON {type(record).__name__}, not an object"
    if "prompt" not in record:
        return f'has no "prompt" field (its fields: {", ".join(sorted(record)) or "none"})'
    if not isinstance(record["prompt"], str) or not record["prompt"]:
        return 'has a "prompt" that is not a non-empty string'
    return None


def read_prompts(path: Path) -> list[str]:
    """The prompts of a JSONL file; ExportError (exit 2) naming the file and line of the first bad line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ExportError(
            f"--prompts {path} cannot be read as UTF-8 text ({err}). Give a JSONL file with one object per "
            f"line, e.g. {EXAMPLE}."
        ) from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if problem := _line_problem(line):
            raise ExportError(
                f"--prompts {path} line {number} {problem}. Each line must be one JSON object with a non-empty "
                f'"prompt" string, e.g. {EXAMPLE}; fix or remove that line.'
            )
        prompts.append(json.loads(line)["prompt"])
    if not prompts:
        raise ExportError(
            f"--prompts {path} holds no prompts. Give one JSON object per line, e.g. {EXAMPLE}."
        )
    return prompts


def record(prompt: str, text: str, ids: list[int], stop: str) -> dict[str, Any]:
    """One output line: the prompt, the completion's text and token ids, and why it stopped."""
    return {"prompt": prompt, "completion": text, "token_ids": ids, "stop": stop}


def write_lines(records: Iterable[dict[str, Any]], out: Path | None) -> None:
    """The records as JSONL on stdout (out None), or into `out`, replacing it only once it is complete."""
    lines = "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in records)
    if out is None:
        print(lines, end="")
        return
    out.parent.mkdir(exist_ok=True)  # at most OUT's own folder (output_file_problem)
    partial = out.with_name(f".{out.name}.partial")
    partial.write_text(lines, encoding="utf-8")
    os.replace(partial, out)
