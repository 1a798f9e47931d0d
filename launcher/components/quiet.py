"""Other libraries' chatter kept off the console: their progress bars and notices that ask nothing of a user.

A run's console is the launcher's lines, the run's progress and what needs attention. Libraries add
their own: transformers draws a progress bar for loading weights and for writing shards, DeepSpeed
logs that it picked the CPU accelerator (on a CPU, where that is the point), bitsandbytes that it uses
its own CPU kernel instead of the optional `kernels` package, torchao that its CUDA-only extensions
do not load on this build, torch that torchao registers enums the old way. None of them changes what
the run does. Here, by default:

- progress bars of transformers and huggingface_hub are off (HF_HUB_DISABLE_PROGRESS_BARS, which both
  read; set in the environment so ranks started from this process inherit it; a value the user set
  in the environment is kept);
- the notices listed in CHATTER are dropped by a logging filter on the logger that emits each;
- what a library prints rather than logs (DeepSpeed's zero_to_fp32: its steps and a tqdm bar) is held
  while it runs (`held_prints`) and passed on without the lines of its known chatter.

`log.verbose=true` (or `train --verbose`, `train-export ... --verbose`) leaves all of it as the
libraries print it. Warnings, errors and everything else those libraries log are untouched.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator

PROGRESS_ENV = "HF_HUB_DISABLE_PROGRESS_BARS"

CHATTER: dict[str, tuple[str, ...]] = {
    "DeepSpeed": ("Setting accelerator to CPU",),
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
}
"""Logger name -> parts of the messages dropped from it (each a notice of one known library)."""


DEEPSPEED_CONSOLIDATION = (
    "Processing zero checkpoint", "Parsing checkpoint created by", "Detected checkpoint of type",
    "Reconstructed fp32 state dict", "Reconstructed Frozen fp32 state dict", "Loading checkpoint shards",
    "Gathering sharded weights",
)  # fmt: skip
"""What deepspeed.utils.zero_to_fp32 prints while it merges a ZeRO checkpoint's shards."""


@contextlib.contextmanager
def held_prints(chatter: tuple[str, ...]) -> Iterator[None]:
    """While inside, hold what is printed; then pass every line on but those holding a part of `chatter`
    (and the blank ends of a progress bar). Everything is passed on with log.verbose, or on an error."""
    if not _installed:
        yield
        return
    out, err = io.StringIO(), io.StringIO()
    failed = True
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield
        failed = False
    finally:
        for held, stream in ((out, sys.stdout), (err, sys.stderr)):
            lines = held.getvalue().splitlines(keepends=True)
            kept = lines if failed else [line for line in lines if line.strip() and not _holds(line, chatter)]
            stream.write("".join(kept))


def _holds(line: str, parts: tuple[str, ...]) -> bool:
    return any(part in line for part in parts)


class _Chatter(logging.Filter):
    """Drops records whose message holds one of `parts`."""

    def __init__(self, parts: tuple[str, ...]) -> None:
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        """False for a record of chatter."""
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that does not format is not ours to judge
            return True
        return not any(part in message for part in self.parts)


_installed: dict[str, _Chatter] = {}
_set_env = False


def install(*, verbose: bool = False) -> None:
    """Quiet this process (and the ranks it starts) unless `verbose`; `verbose` undoes an earlier install."""
    if verbose:
        uninstall()
        return
    global _set_env
    if PROGRESS_ENV not in os.environ:
        os.environ[PROGRESS_ENV] = "1"
        _set_env = True
    _progress_bars(enabled=os.environ[PROGRESS_ENV].strip().lower() not in ("1", "true", "yes", "on"))
    for name, parts in CHATTER.items():
        if name not in _installed:
            _installed[name] = _Chatter(parts)
            logging.getLogger(name).addFilter(_installed[name])


def uninstall() -> None:
    """Show the chatter again: the filters removed, progress bars as the environment had them."""
    global _set_env
    for name, chatter in _installed.items():
        logging.getLogger(name).removeFilter(chatter)
    _installed.clear()
    if _set_env:
        os.environ.pop(PROGRESS_ENV, None)
        _set_env = False
        _progress_bars(enabled=True)


def _progress_bars(*, enabled: bool) -> None:
    """Switch the bars of libraries already imported (the environment variable is read at their import).

    huggingface_hub warns that the variable it read at import wins over a call; transformers' own bars
    (loading weights, writing shards) follow the call all the same, and a download's never come here.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
        elif "huggingface_hub" in sys.modules:
            from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

            (enable_progress_bars if enabled else disable_progress_bars)()
