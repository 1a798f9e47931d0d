"""The DeepSpeed config a run will hand to deepspeed.initialize, checked by DeepSpeed's own config classes before launch.

`DeepSpeedConfig(dict)` builds every section's pydantic model (DeepSpeedZeroConfig, the fp16/bf16
configs, CompileConfig, ...) and runs DeepSpeed's own assertions without a process group (it
falls back to world size 1, so the batch total is left to DeepSpeed to derive). It runs in a
child process: importing deepspeed takes seconds and fixes DeepSpeed's accelerator for the whole
process, which an inline rank must still choose itself. A failure is attributed to the section
whose value DeepSpeed rejects, down to the key pydantic names.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from launcher.parallel.deepspeed_sections import verdict
from launcher.spec import SpecError

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_BASE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
TIMEOUT_S = 300
"""How long the child may take (importing deepspeed on a loaded machine: seconds to a minute)."""


def problems(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(dotted key, DeepSpeed's complaint) for each value of `config` DeepSpeed refuses; [] when it builds."""
    return list(_checked(json.dumps(config, sort_keys=True)))


CHECKED_DECIDED = ("fp16", "bf16", "bfloat16")
"""Sections the spec decides whose other keys (loss scaling, auto_cast, ...) the user's file may still hold."""


def errors(path: str, filled: dict[str, Any]) -> list[SpecError]:
    """One SpecError per value DeepSpeed refuses among the sections of the user's file that reach it.

    `filled` is the user's config with its "auto" values filled from the spec. The sections the launcher
    generates alone (batch, optimizer, ...) are left out: they are the launcher's, and the check of the
    rest then gives the same answer (and the same cache entry) for one file under many specs.
    """
    config = {k: v for k, v in filled.items() if verdict(k) == "honoured" or k in CHECKED_DECIDED}
    out = []
    for key, message in problems(config):
        out.append(
            SpecError(
                (f"deepspeed_config:{key}" if key else "parallel.deepspeed_config",),
                f'DeepSpeed refuses {key or "the sections together"} in the DeepSpeed JSON {path} (its "auto" '
                f"values filled from the spec): {message}. Every rank would stop there at start: fix or remove "
                "the key in the JSON (docs/deepspeed.md lists what each section may hold).",
            )
        )
    return out


def _cache_file(text: str) -> Path | None:
    """Where the verdict on `text` under the installed DeepSpeed is kept; None without deepspeed."""
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None
    key = hashlib.sha256(f"{version}\n{text}".encode()).hexdigest()[:32]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "launcher" / "deepspeed_checks" / f"{key}.json"


@functools.lru_cache(maxsize=64)
def _checked(text: str) -> tuple[tuple[str, str], ...]:
    """DeepSpeed's complaints about a config (JSON text), from the cache or a child process."""
    cache = _cache_file(text)
    if cache is None:
        return ()  # deepspeed is not installed: the deepspeed rules say so
    if cache.is_file():
        return tuple((k, m) for k, m in json.loads(cache.read_text()))
    found = _run_child(text)
    if found is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(found))
        partial.replace(cache)
    return tuple(found or ())


def _run_child(text: str) -> list[tuple[str, str]] | None:
    """DeepSpeed's complaints from a child process; None when it could not tell."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}  # what the config holds, not this machine's devices
    try:
        done = subprocess.run(
            [sys.executable, "-m", "launcher.parallel.deepspeed_schema"],
            input=text, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None  # a machine too loaded to import deepspeed: the rank still reports a bad value
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return None  # deepspeed not importable here: the rank reports what it refuses
    return [(key, message) for key, message in json.loads(lines[-1])]


def _describe(err: Exception, section: str) -> list[tuple[str, str]]:
    """(dotted key, message) of each complaint in a DeepSpeed config error."""
    from pydantic import ValidationError

    if isinstance(err, ValidationError):
        out = []
        for item in err.errors():
            where = ".".join(str(part) for part in (section, *item["loc"]) if part != "")
            value = json.dumps(item.get("input"), default=str)
            out.append((where, f"{item['msg']} (given {value[:80]})"))
        return out
    return [(section, f"{type(err).__name__}: {err}".strip())]


def check(config: dict[str, Any]) -> list[tuple[str, str]]:
    """In this process (with deepspeed imported): DeepSpeed's complaints about `config`, section by section."""
    from deepspeed.runtime.config import DeepSpeedConfig

    whole = {**_BASE, **{k: v for k, v in config.items() if k not in BATCH_KEYS}}  # the batch: the launcher's
    try:
        DeepSpeedConfig(whole)
        return []
    except Exception as err:  # pydantic, assertions and DeepSpeedConfigError: named below
        failure = err
    found: list[tuple[str, str]] = []
    for key, value in config.items():
        if key in BATCH_KEYS:
            continue
        try:
            DeepSpeedConfig({**_BASE, key: value})
        except Exception as err:  # the section alone fails: name its keys
            found += _describe(err, key)
    return found or _describe(failure, "")


def main() -> None:
    """Read a DeepSpeed config as JSON on stdin; print DeepSpeed's complaints as one JSON line."""
    import logging

    logging.disable(logging.WARNING)
    config = json.loads(sys.stdin.read())
    print(json.dumps(check(config)))


if __name__ == "__main__":
    main()
