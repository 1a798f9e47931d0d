"""Why a tokenizer folder does not load, naming the file: transformers' own errors often name none.

A tokenizer.json that is not one (truncated, another file's content, a field missing) makes
transformers raise e.g. `KeyError: 'added_tokens'`; the message built here names the file the
tokenizers library cannot read, and the fix.
"""

from __future__ import annotations

from pathlib import Path


def load_failure(path: str, err: Exception) -> str:
    """Why a tokenizer folder does not load, naming the file that fails where one can be told (its
    tokenizer.json when the tokenizers library cannot read it), and the fix."""
    reason = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, KeyError):  # transformers' KeyError says only the key: 'added_tokens'
        reason = f"it lacks the field {reason}"
    failing = _failing_file(Path(path))
    where = f"'{failing}' in the tokenizer folder" if failing else "the folder"
    return (
        f"the tokenizer in '{path}' does not load: {where} is damaged or not a tokenizer file ({reason}); check "
        "that the folder is a complete `save_pretrained` copy of the tokenizer (tokenizer_config.json with its "
        "tokenizer files), or save it again with `tokenizer.save_pretrained(DIR)`"
    )


def _failing_file(folder: Path) -> Path | None:
    """The folder's tokenizer.json when the tokenizers library cannot read it, else None."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        from tokenizers import Tokenizer as FastTokenizer

        FastTokenizer.from_file(str(file))
    except ImportError:
        return None
    except Exception:  # the library's own error type: the file is what fails
        return file
    return None
