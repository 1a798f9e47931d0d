"""A user's own reward functions: loaded by path from the file the user named, and called as TRL calls them.

`reward.functions=[path/to/rewards.py:fn]` names code on purpose (the user's, on the command line): the
file is executed as a module of its own, once per process and content (so two functions of one file share
it), from the file on disk, never from a checkpoint. Its sha256 (`file_digest`) is what spec.yaml and each
checkpoint record, so a changed file is seen before a resume or a reproduction uses it.

The call follows TRL's GRPOTrainer (`_calculate_rewards`): keyword arguments `prompts`, `completions`,
`completion_ids`, each record field (the record's keys but prompt, completion and completion_ids) as a
list, `trainer_state`, `log_metric(name, value)` and `log_extra(column, values)`. A function without
`**kwargs` gets only the arguments it names (TRL would fail on the others), and an `async def` one is awaited
(launcher.components.rewards), so a TRL reward function works unchanged.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from launcher.config.reward import split_function

_MODULES: dict[tuple[str, str], ModuleType] = {}
"""(resolved path, digest) -> the module executed from it, so each file content runs once per process."""


class RewardFileError(ValueError):
    """A reward.functions entry that cannot be used: its message is one paragraph naming the file and the fix."""


def file_path(entry: str, base_dir: Path) -> Path:
    """The file of a reward.functions entry, a relative path read from `base_dir` (where train was typed)."""
    path = Path(split_function(entry)[0]).expanduser()
    return path if path.is_absolute() else Path(base_dir) / path


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes, in hex."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_function(entry: str, base_dir: Path) -> tuple[Callable[..., Any], str]:
    """The function a "path/to/file.py:fn" entry names and the digest of the file it came from; RewardFileError if not."""
    path_text, name = split_function(entry)
    if not name or not path_text:
        raise RewardFileError(
            f"reward.functions entry '{entry}' does not name a function: write it as path/to/file.py:function_name."
        )
    path = file_path(entry, base_dir)
    if not path.is_file():
        raise RewardFileError(
            f"reward.functions entry '{entry}': the file {path} does not exist. Give the path of your rewards file "
            "(relative to the directory train is run from, or absolute)."
        )
    digest = file_digest(path)
    module = _module(path.resolve(), digest, entry)
    function = getattr(module, name, None)
    if function is None:
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardFileError(
            f"reward.functions entry '{entry}': {path} defines no '{name}' (its functions: "
            f"{', '.join(defined) or 'none'}). Name one of them after the ':'."
        )
    if not callable(function):
        raise RewardFileError(
            f"reward.functions entry '{entry}': '{name}' in {path} is a {type(function).__name__}, not a function. "
            "Name a function taking (prompts, completions, **kwargs) and returning one float per completion."
        )
    return function, digest


def _module(path: Path, digest: str, entry: str) -> ModuleType:
    """The module executed from `path` (whose bytes have `digest`), once per process and content."""
    key = (str(path), digest)
    if key in _MODULES:
        return _MODULES[key]
    name = f"launcher_user_rewards_{digest[:16]}_{path.stem.replace('-', '_')}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RewardFileError(
            f"reward.functions entry '{entry}': {path} is not a Python file (it must end in .py)."
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException as err:  # the user's code: whatever it raises (SystemExit included) is reported
        sys.modules.pop(name, None)
        where = _error_line(err, path)
        raise RewardFileError(
            f"reward.functions entry '{entry}': running {path} failed{where} with {type(err).__name__}: {err}. "
            "Fix the file (it is run as a module: its imports must be installed)."
        ) from None
    _MODULES[key] = module
    return module


def _error_line(err: BaseException, path: Path) -> str:
    """' at line N' of the user's file where `err` was raised (a syntax error's own line), else ''."""
    if isinstance(err, SyntaxError) and err.lineno:
        return f" at line {err.lineno}"
    line = None
    tb = err.__traceback__
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename) == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" at line {line}" if line else ""


def call_kwargs(function: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `function` takes: all of them with **kwargs, else only those it names."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: give it everything, as TRL does
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return kwargs
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in named}
