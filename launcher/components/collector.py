"""Python's cyclic collector while a process starts up: off, because what start-up builds lives until exit.

Importing Hydra, OmegaConf, rich and the schemas, then torch and the rank's modules, makes about half
a million objects that live as long as the process (modules, classes, functions, registered
schemas). Python's collector walks every one of them each time their number has grown by a quarter,
and finds next to nothing to free: in `train train.max_steps=1` those passes were about a third of
the process's CPU time (docs/performance.md, "Startup"). So start-up runs with automatic collection
off, as long-running Python services start (gc.disable early, gc.freeze once start-up is over):

- the console entry (front/entry.py) pauses it first thing; the launching process resumes it once
  the spec is built (`resume`: start-up's garbage collected once, what lives frozen, so that later
  passes, e.g. while the local backend waits for its ranks or a corpus is tokenized, skip it);
- a rank started in the launching process (the inline backend) runs its imports and build with it
  paused (`paused`) and what the imports made frozen (`frozen`), so that the one collection of the
  loop's own policy (rank/collection.py: collect, freeze, collect at the loop's pauses, unfreeze at
  its end) walks only what the build made;
- at the console process's exit everything is frozen (`freeze_for_exit`): the interpreter's last
  collections skip what lived until then, which the process's end frees anyway.

A process that did not pause the collector here (a test calling `cli.run`) keeps it as it was.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_paused_here = False
"""Whether `pause` turned automatic collection off (so that `resume` turns it back on)."""


def pause() -> None:
    """Turn automatic collection off for the start-up of this process (the console entry calls it first)."""
    global _paused_here
    if gc.isenabled():
        gc.disable()
        _paused_here = True


def resume() -> None:
    """Start-up is over: collect its garbage once, freeze what lives, collect automatically again (if `pause` stopped it)."""
    global _paused_here
    if not _paused_here:
        return
    _paused_here = False
    gc.collect()
    gc.freeze()
    gc.enable()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Automatic collection off inside (a rank's imports and build in this process); as it was after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Every object alive now (a rank's imported modules) out of the collector's passes inside; back in after."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def freeze_for_exit() -> None:
    """The process ends: keep every object out of the interpreter's last collections (its end frees them all)."""
    gc.freeze()
