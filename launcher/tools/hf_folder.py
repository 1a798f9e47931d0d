"""Hugging Face folders: the run's tokenizer as a transformers tokenizer, and the atomic folder write.

The byte tokenizer (`tokenizer.kind=bytes`, UTF-8 bytes as ids 0..255) becomes a `tokenizers`
byte-level BPE with no merges: the 256 byte tokens as vocabulary, id == byte value, spelled as
GPT-2's byte-to-unicode strings, split without a regex or prefix space and decoded byte-level. It
encodes every string exactly as `ByteTokenizer` does. Its eos (the 0 byte, id 0) is recorded in
config.json and generation_config.json, not declared as a special token: a special token is matched
in the text before bytes are split, so declaring the 0 byte's spelling (U+0100) would turn that
character in user text into eos.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from launcher.components.data.byte_tokenizer import ByteTokenizer
from launcher.components.data.hf_tokenizer import open_folder
from launcher.components.data.tokenizer_folder import folder_problem
from launcher.components.files.safe_load import RefusedFile
from launcher.components.files.tokenizer_file import load_failure
from launcher.config.tokenizer import TokenizerConfig
from launcher.tools.tool_args import output_folder_problem


class ExportError(RuntimeError):
    """The source or the destination cannot be used; the message says why and what to give instead."""


def byte_tokenizer() -> Any:
    """A transformers fast tokenizer equivalent to `ByteTokenizer` (256 byte tokens, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={spelling[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def load_tokenizer(cfg: TokenizerConfig) -> Any:
    """The run's tokenizer as a transformers tokenizer: the local folder (kind=hf) or `byte_tokenizer()`."""
    if cfg.kind == "bytes":
        return byte_tokenizer()
    reason = folder_problem(cfg.path)
    if reason is not None:
        raise ExportError(
            f"the run's tokenizer cannot be read: {reason}. Put the tokenizer folder back at that path "
            "(the spec records where training read it)."
        )
    try:
        return open_folder(cfg.path)
    except (ImportError, RefusedFile):  # a missing package, or a file that needs code: their messages say so
        raise
    except Exception as err:  # transformers' KeyError and the tokenizers library's errors name no file
        raise ExportError(f"the run's {load_failure(str(cfg.path), err)}.") from None


def special_ids(cfg: TokenizerConfig, tokenizer: Any) -> dict[str, int | None]:
    """bos/eos/pad token ids for config.json and generation_config.json (bytes: eos is the 0 byte)."""
    if cfg.kind == "bytes":
        return {"bos_token_id": None, "eos_token_id": ByteTokenizer.eos_id, "pad_token_id": None}
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def refuse_existing(out: Path, *, force: bool) -> None:
    """Raise unless `out` is absent or an empty folder, or `force` allows replacing it; or when its folder
    cannot be made (tool_args.output_folder_problem)."""
    if problem := output_folder_problem(out):
        raise ExportError(problem)
    if force or not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    raise ExportError(
        f"{out} already exists and is not an empty folder; the export would replace it. Give another "
        "OUT, or add --force to replace it (the old content is removed only after the new folder is complete)."
    )


def write_folder(model: Any, tokenizer: Any, out: Path, ids: dict[str, int | None], *, force: bool) -> None:
    """config.json, model.safetensors, generation_config.json and the tokenizer files, renamed into `out` at the end."""
    from transformers import GenerationConfig

    refuse_existing(out, force=force)
    for name, value in ids.items():
        setattr(model.config, name, value)
    model.generation_config = GenerationConfig.from_model_config(model.config)
    out.parent.mkdir(exist_ok=True)  # at most OUT's own folder (refuse_existing)
    partial = out.with_name(f".{out.name}.partial")
    _remove(partial)
    try:
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        old = out.with_name(f".{out.name}.old")
        _remove(old)
        if out.exists():
            out.rename(old)
        partial.rename(out)
        _remove(old)
    finally:
        _remove(partial)


def _remove(path: Path) -> None:
    """Delete a file or folder if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
