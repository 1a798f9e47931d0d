"""Reading files that may have been changed by someone else: data comes back, code never runs.

Every pickle the launcher reads goes through an allowlist: torch files through torch's weights-only
reader (`load_tensor_file`), DCP metadata through launcher.components.files.dcp_reader. A file that needs
anything else is refused with `RefusedFile`, which names the file; nothing of it has run by then.
A checkpoint's COMPLETE manifest holds digests against damage, not a signature: whoever can
change a file can change its digest, so the readers never trust a file because its digest matches.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import pickletools
import re
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


class RefusedFile(ValueError):
    """A file that holds more than data (a global outside the allowlist, or no valid structure); never loaded."""

    def __init__(self, path: Path | str, reason: str, names_code: bool, advice: str | None = None) -> None:
        self.path, self.reason, self.names_code, self.advice = Path(path), reason, names_code, advice
        if names_code:
            text = (
                f"{path} was refused: {reason}, and only plain data is read from a file. Nothing in it was run. "
                + (
                    advice
                    or "The launcher never writes such a file, so it was changed or replaced after it was written (a "
                    "matching digest in the checkpoint's COMPLETE manifest proves nothing: whoever changed the file "
                    "can update it). Delete that checkpoint, or restore the file from a source you trust, and run again."
                )
            )
        else:
            text = (
                f"{path} was refused: it is not a valid file of its kind ({reason}). Nothing in it was run. "
                + (advice or "It is damaged, or not the file the launcher wrote.")
            )
        super().__init__(text)

    def __reduce__(self) -> tuple:
        """Pickled whole: DCP gathers a rank's failure across processes."""
        return (type(self), (self.path, self.reason, self.names_code, self.advice))


def weights_only_reason(err: pickle.UnpicklingError) -> str | None:
    """What torch's weights-only reader objected to, without its advice to load unsafely; None: not its error."""
    text = str(err)
    if not text.startswith("Weights only load failed"):
        return None
    named = re.search(r"GLOBAL ([\w.]+)", text)
    if named:
        return f"it names {named.group(1)}"
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(\n\n|$)", text, re.S)
    return " ".join(found.group(1).split()) if found else "torch's weights-only reader refused it"


def names_code(reason: str) -> bool:
    """Whether a weights-only refusal was about a global (a callable or class) rather than a malformed pickle."""
    return reason.startswith("it names ")


def load_tensor_file(
    path: Path | str | IO[bytes], *, name: Path | str | None = None, mmap: bool = False
) -> object:
    """torch.load with weights_only=True on the CPU; a file that needs more is refused (RefusedFile naming `name` or it).

    A pickle the weights-only reader stops at before it reaches a global (an opcode it does not
    know, e.g. protocol 4's FRAME) is read once more as opcodes only (`named_global`): one that
    names code outside the allowlist is refused as code, not as damage, whatever its container.
    """
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap or None)
    except pickle.UnpicklingError as err:
        reason = weights_only_reason(err)
        if reason is None:
            raise
        if not names_code(reason) and (named := named_global(path)) is not None:
            reason = f"it names {named}"
        raise RefusedFile(name or str(path), reason, names_code=names_code(reason)) from None


_NAME_OPS = {"GLOBAL", "INST"}
"""Opcodes whose argument is "module name" of a global."""
_STRING_OPS = {
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "BINUNICODE8",
    "UNICODE",
    "SHORT_BINSTRING",
    "BINSTRING",
    "STRING",
}
_MEMO_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_MEMO_GETS = {"GET", "BINGET", "LONG_BINGET"}
_MAX_PICKLES = 8
"""Pickles read one after another from a file's start (torch's legacy format writes five)."""


def _allowed(module: str, name: str) -> bool:
    """Whether torch's weights-only reader admits the global module.name (its allowlist, dtypes, storages)."""
    import torch
    from torch import _weights_only_unpickler as reader

    full = f"{module}.{name}"
    if full in reader._get_allowed_globals() or full in reader._get_user_allowed_globals():
        return True
    found = getattr(torch, name, None) if module == "torch" else None
    return isinstance(found, torch.dtype) or (isinstance(found, type) and name.endswith("Storage"))


def _globals_of(stream: IO[bytes]) -> Iterator[str]:
    """module.name of each global one pickle names, read as opcodes (nothing is built); '?' for one built from
    values this reading cannot follow; stops at STOP (ValueError on what is not a pickle)."""
    pushed: list[object] = []  # the values of recent string pushes and memo reads (None: another value)
    memo: dict[object, object] = {}
    for op, arg, _ in pickletools.genops(stream):
        if op.name in _NAME_OPS:
            module, _, name = str(arg).partition(" ")
            yield "?" if not name else f"{module}.{name}"
        elif op.name == "STACK_GLOBAL":
            module, name = pushed[-2:] if len(pushed) >= 2 else [None, None]
            yield f"{module}.{name}" if isinstance(module, str) and isinstance(name, str) else "?"
        elif op.name in {"EXT1", "EXT2", "EXT4"}:
            yield "?"
        if op.name in _STRING_OPS:
            pushed.append(arg)
        elif op.name in _MEMO_GETS:
            pushed.append(memo.get(arg))
        elif op.name in _MEMO_PUTS or op.name == "MEMOIZE":
            memo[arg if op.name in _MEMO_PUTS else len(memo)] = pushed[-1] if pushed else None
        elif op.name not in {"FRAME", "PROTO", "STOP"}:
            pushed.append(None)


def _pickles(handle: IO[bytes]) -> Iterator[IO[bytes]]:
    """The pickle streams a file holds: each .pkl record of a torch zip file, else the file read from its start."""
    handle.seek(0)
    if zipfile.is_zipfile(handle):
        handle.seek(0)
        with zipfile.ZipFile(handle) as archive:
            for member in archive.namelist():
                if member.endswith(".pkl"):
                    yield io.BytesIO(archive.read(member))
        return
    handle.seek(0)
    for _ in range(_MAX_PICKLES):
        yield handle  # read on from where the previous pickle stopped


def _first_named(handle: IO[bytes]) -> str | None:
    try:
        for stream in _pickles(handle):
            try:
                for named in _globals_of(stream):
                    module, _, name = named.rpartition(".")
                    if named == "?" or not _allowed(module, name):
                        return "a global it builds from values on its stack" if named == "?" else named
            except (ValueError, EOFError, struct.error):  # not (or no longer) a pickle: tensor data or damage
                break
    except (OSError, zipfile.BadZipFile):
        return None
    return None


def named_global(source: Path | str | IO[bytes]) -> str | None:
    """The first global outside torch's weights-only allowlist that a file's pickles name ('?' when they build one
    from values this reading cannot follow), read as opcodes only (a zip's records, not its tensors); None when
    they name none."""
    if isinstance(source, (str, Path)):
        with open(source, "rb") as handle:
            return _first_named(handle)
    return _first_named(source) if source.seekable() else None


def first_refused(paths: list[Path]) -> RefusedFile | None:
    """The refusal of the first of `paths` that torch's weights-only reader will not load (mmap: no tensor is read)."""
    for path in paths:
        try:
            load_tensor_file(path, mmap=True)
        except RefusedFile as err:
            return err
        except (OSError, RuntimeError, pickle.UnpicklingError):
            continue
    return None


def weights_refusal(
    err: pickle.UnpicklingError, files: list[Path], fallback: Path | str, advice: str | None = None
) -> RefusedFile | None:
    """The refusal behind a library's weights-only UnpicklingError, naming the first of `files` that torch
    refuses (else `fallback`); None when `err` is no weights-only refusal."""
    reason = weights_only_reason(err)
    if reason is None:
        return None
    refused = first_refused(files)
    if refused is not None and advice is None:
        return refused
    return RefusedFile(refused.path if refused else fallback, reason, names_code(reason), advice=advice)


def refusal_in(err: BaseException) -> RefusedFile | None:
    """The RefusedFile behind `err`: itself, its cause or context, or one rank's failure inside DCP's CheckpointException."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, RefusedFile):
            return current
        todo += [current.__cause__, current.__context__]
        todo += [arg for arg in current.args if isinstance(arg, BaseException)]  # a cause lost in pickling
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


_PLAIN_TAGS = {
    f"tag:yaml.org,2002:{kind}"
    for kind in ("str", "int", "float", "bool", "null", "map", "seq", "timestamp", "binary", "merge", "value")
}
"""YAML's own tags for plain data; any other tag (!!python/..., a local !tag) asks a loader to build an object."""


def yaml_tag(path: Path) -> str | None:
    """The first tag in a YAML file that is not plain data (read as events, nothing is built), or None."""
    import yaml

    try:
        with open(path, "rb") as handle:
            for event in yaml.parse(handle, Loader=yaml.SafeLoader):
                tag = getattr(event, "tag", None)
                if tag is not None and tag not in _PLAIN_TAGS and tag not in {"!", "?"}:
                    return tag
    except yaml.YAMLError:
        return None  # not YAML at all: damage, which the reader reports
    return None


def refused_yaml(path: Path, advice: str) -> RefusedFile | None:
    """RefusedFile naming a YAML file with a tag that names code (`yaml_tag`), else None."""
    tag = yaml_tag(path) if Path(path).is_file() else None
    if tag is None:
        return None
    shown = tag.replace("tag:yaml.org,2002:", "!!")
    return RefusedFile(path, f"it holds the YAML tag {shown}, which names code", True, advice=advice)


def _safetensors_problem(path: Path) -> str | None:
    """Why safetensors will not open `path` (a header that is not JSON, offsets outside the file), or None."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except Exception as err:  # safetensors raises its own SafetensorError, and OSError
        return str(err)
    return None


_FOLDER_ADVICE = "Get the model folder again from a source you trust (model.safetensors holds tensors only)."


@contextlib.contextmanager
def refusing_folder(folder: Path | str) -> Iterator[None]:
    """Turn a model folder's unreadable weights into RefusedFile naming the file.

    transformers reads pytorch_model.bin weights-only and safetensors checks its header; their own
    errors name no file, and torch's advises loading with weights_only=False.
    """
    try:
        yield
    except pickle.UnpicklingError as err:
        refused = weights_refusal(err, sorted(Path(folder).glob("*.bin")), folder, advice=_FOLDER_ADVICE)
        if refused is None:
            raise
        raise refused from None
    except Exception as err:
        if type(err).__name__ != "SafetensorError":
            raise
        for path in sorted(Path(folder).glob("*.safetensors")):
            problem = _safetensors_problem(path)
            if problem:
                raise RefusedFile(path, problem, False, advice=_FOLDER_ADVICE) from None
        raise RefusedFile(folder, str(err), False, advice=_FOLDER_ADVICE) from None
