"""A Hugging Face tokenizer folder judged by reading its files, before transformers loads it: tokenizer files
present, no code of its own, BPE files complete, the packages its slow model needs installed; and the byte
tokenizer `train-export` writes recognised."""

from __future__ import annotations

import json
from pathlib import Path

from launcher.components.files.safe_load import RefusedFile
from launcher.components.model.hf_files import NO_REMOTE_CODE
from launcher.config.tokenizer import INSTALL_HINT, MODEL_FILES, TOKENIZER_FILES


def folder_problem(path: str | None) -> str | None:
    """Why `path` is not a tokenizer folder, or None; reads the folder only (no transformers import)."""
    if not path:
        return "tokenizer.kind=hf needs tokenizer.path, a local folder holding a Hugging Face tokenizer"
    folder = Path(path)
    if not folder.is_dir():
        return f"tokenizer.path '{path}' is not a directory"
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return (
            f"'{path}' holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); save one there with "
            "`tokenizer.save_pretrained(DIR)`"
        )
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            settings = json.loads(config.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return f"{config} is not valid JSON ({err})"
        problem = _custom_code_problem(settings, config)
        if problem:
            return problem
    return _vocab_files_problem(folder) or _missing_packages(folder)


def _custom_code_reason(settings: object) -> str | None:
    """Why a tokenizer_config.json needs the folder's own code (auto_map to a class transformers lacks), or None."""
    if not isinstance(settings, dict) or not settings.get("auto_map"):
        return None
    import transformers  # only for a folder that asks for code: is the class one transformers ships?

    name = settings.get("tokenizer_class")
    if isinstance(name, str) and any(
        hasattr(transformers, n) for n in (name, f"{name}Fast", name.removesuffix("Fast"))
    ):
        return None
    return (
        f"it names code of its own (auto_map {settings['auto_map']} for tokenizer_class {name!r}, which "
        "transformers does not ship)"
    )


def _custom_code_problem(settings: object, config: Path) -> str | None:
    reason = _custom_code_reason(settings)
    return f"{config} was refused: {reason}. {NO_REMOTE_CODE}" if reason else None


def refuse_custom_tokenizer(folder: str | Path) -> None:
    """RefusedFile naming the folder's tokenizer_config.json when it needs the folder's own code."""
    config = Path(folder) / "tokenizer_config.json"
    try:
        reason = _custom_code_reason(json.loads(config.read_text()))
    except (OSError, ValueError):
        return
    if reason:
        raise RefusedFile(config, reason, True, advice=NO_REMOTE_CODE)


def _vocab_files_problem(folder: Path) -> str | None:
    """Why a folder of slow BPE files (vocab.json, merges.txt) cannot be read, or None."""
    if (folder / "tokenizer.json").is_file() or not (folder / "vocab.json").is_file():
        return None
    if any((folder / name).is_file() for name in MODEL_FILES):
        return None
    if not (folder / "merges.txt").is_file():
        return (
            f"'{folder}' holds vocab.json but not the merges.txt that goes with it (a BPE tokenizer needs both); "
            "copy merges.txt from where vocab.json came from"
        )
    if not (folder / "tokenizer_config.json").is_file() and not (folder / "config.json").is_file():
        return (
            f"'{folder}' holds vocab.json and merges.txt but no tokenizer_config.json saying which tokenizer reads "
            'them; add one, for GPT-2\'s files `{"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}`, '
            "or save the tokenizer there with `tokenizer.save_pretrained(DIR)`"
        )
    return None


def _missing_packages(folder: Path) -> str | None:
    """Which package reading the folder's slow tokenizer model needs and lacks (sentencepiece, protobuf, tiktoken)."""
    if (folder / "tokenizer.json").is_file():
        return None  # the fast tokenizer is read by `tokenizers` alone
    model = next((folder / name for name in MODEL_FILES if (folder / name).is_file()), None)
    if model is None:
        return None
    if is_tiktoken_file(model):
        kind, needed = "a tiktoken BPE file", ("tiktoken",)
    else:
        kind, needed = "a SentencePiece model", ("sentencepiece", "google.protobuf")
    missing = [name for name in needed if not _importable(name)]
    if not missing:
        return None
    packages = " ".join("protobuf" if name == "google.protobuf" else name for name in missing)
    return (
        f"{model} is {kind}, and reading it needs the {packages} package(s), which are not installed: "
        + INSTALL_HINT.format(packages=packages)
    )


def is_tiktoken_file(path: Path) -> bool:
    """Whether a tokenizer.model is tiktoken's text format (base64 token, space, rank per line), not SentencePiece's protobuf."""
    with path.open("rb") as file:
        first = file.readline(512).strip()
    token, _, rank = first.partition(b" ")
    return bool(token) and rank.isdigit() and all(c in _BASE64 for c in token)


_BASE64 = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=")


def _importable(name: str) -> bool:
    """Whether `name` imports (a package present on disk but blocked or broken counts as missing)."""
    import importlib

    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def is_byte_export(folder: Path) -> bool:
    """Whether the folder's tokenizer.json is the byte tokenizer `train-export` writes for a bytes run (256 byte
    tokens, no merges, nothing added): its eos lives in config.json, so the bytes tokenizer reads it exactly."""
    file = folder / "tokenizer.json"
    if not file.is_file() or file.stat().st_size > 64_000:
        return False
    try:
        saved = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    model = saved.get("model") if isinstance(saved, dict) else None
    if not isinstance(model, dict) or saved.get("added_tokens"):
        return False
    return model.get("type") == "BPE" and len(model.get("vocab") or {}) == 256 and not model.get("merges")
