"""The DeepSpeed config a run will hand to deepspeed.initialize, checked by DeepSpeed's own config classes before launch.

`DeepSpeedConfig(dict)` builds every section's pydantic model (DeepSpeedZeroConfig, the fp16/bf16
configs, CompileConfig, ...) and runs DeepSpeed's own assertions without a process group (it
falls back to world size 1, so the batch total is left to DeepSpeed to derive). It runs in one
child process, kept for the launching process's life: importing deepspeed takes seconds and fixes
DeepSpeed's accelerator for the whole process, which an inline rank must still choose itself. A failure is attributed to the section
whose value DeepSpeed rejects, down to the key pydantic names.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from launcher.parallel.deepspeed_sections import verdict
from launcher.spec import SpecError

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_BASE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
TIMEOUT_S = 300
"""How long the child may take per config (importing deepspeed on a loaded machine: seconds to a minute)."""
SERVE = "--serve"
"""The child's argument for answering configs line by line until its stdin ends."""
MARK = "@@deepspeed-verdict "
"""Prefix of the child's answer lines (deepspeed may print its own lines on stdout)."""


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


class _Checker:
    """One child process importing deepspeed once and answering config after config (a sweep's points,
    a suite's cases), one JSON line in and one marked JSON line out; restarted if it dies or stalls."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen[str]:
        env = {**os.environ, "DS_ACCELERATOR": "cpu"}  # what the config holds, not this machine's devices
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.parallel.deepspeed_schema", SERVE],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )  # fmt: skip
        self._lines = lines = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        atexit.register(_close, proc)
        return proc

    def ask(self, text: str) -> list[tuple[str, str]] | None:
        """DeepSpeed's complaints about one config (JSON text); None when the child could not tell."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            try:
                self._proc.stdin.write(json.dumps(text) + "\n")
                self._proc.stdin.flush()
            except OSError:
                return self._drop()
            deadline = time.monotonic() + TIMEOUT_S
            while (left := deadline - time.monotonic()) > 0:
                try:
                    line = self._lines.get(timeout=left)
                except queue.Empty:
                    break
                if line is None:
                    break  # deepspeed not importable here: the rank reports what it refuses
                if line.startswith(MARK):
                    return [(key, message) for key, message in json.loads(line[len(MARK) :])]
            # a machine too loaded to import deepspeed, or a child that died: the rank still reports a bad value
            return self._drop()

    def _drop(self) -> None:
        """Stop a child that failed or stalled; the next question starts a fresh one."""
        if self._proc is not None:
            _close(self._proc)
        self._proc = None
        return None


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    """Move the child's output lines to `lines`, then None at its end."""
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _close(proc: subprocess.Popen[str]) -> None:
    """End a checker child: its stdin closed ends its loop; a stalled one is killed."""
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_CHECKER = _Checker()


def _run_child(text: str) -> list[tuple[str, str]] | None:
    """DeepSpeed's complaints from the checker child; None when it could not tell."""
    return _CHECKER.ask(text)


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
    """With SERVE: answer each stdin line (a config's JSON text, JSON-quoted) with MARK and DeepSpeed's
    complaints as one JSON line, until stdin ends. Without: one config as JSON on stdin, one line out."""
    import logging

    logging.disable(logging.WARNING)
    if SERVE not in sys.argv[1:]:
        print(json.dumps(check(json.loads(sys.stdin.read()))))
        return
    for line in sys.stdin:
        print(MARK + json.dumps(check(json.loads(json.loads(line)))), flush=True)


if __name__ == "__main__":
    main()
