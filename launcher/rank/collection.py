"""Python's cyclic garbage collector, run only where the loop already pauses.

Left alone, the collector runs whenever allocations outnumber frees by 700 objects, which a training
step does many times over (autograd nodes, hooks, DDP's bucket callbacks). Each full pass walks
every object the process holds: the model, its optimizer state and every imported module, some
millions on a rank. On a busy machine such a pass gets descheduled halfway, and with several ranks
one rank's pause holds all others at the next collective: steps 2-6x slower in windows (a native
profile of a DDP rank showed 7.6% of samples in the collector). So, as large trainers do
(Megatron-LM, torchtitan), the loop freezes what set-up built (moved to a generation no pass walks),
switches automatic collection off, and collects the young generations itself at log steps, where
it already reads values back; a full collection at evaluation steps returns cycles
that aged into the oldest generation. On exit the collector is as it was.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

YOUNG = 1
"""The generations collected at log steps: 0 and 1 (cheap, and where a step's cycles are)."""


@contextlib.contextmanager
def collect_at_pauses() -> Iterator[None]:
    """Freeze the set-up's objects and turn automatic collection off for the loop; restore on exit."""
    was_enabled = gc.isenabled()
    gc.collect()  # the set-up's garbage goes now, so that freezing keeps only live objects
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def collect(*, full: bool = False) -> None:
    """Collect at a pause of the loop: the young generations, or everything (`full`)."""
    gc.collect() if full else gc.collect(YOUNG)
