"""The loop's garbage collection: off between its pauses, set-up frozen, and restored afterwards."""

from __future__ import annotations

import gc
import weakref

from launcher.rank import collection


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_collector_is_off_in_the_loop_and_as_it_was_after() -> None:
    assert gc.isenabled()
    with collection.collect_at_pauses():
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        garbage = weakref.ref(Cycle())  # only a cyclic collection returns it
        for _ in range(2000):
            Cycle()  # far past the automatic threshold (700): nothing collects on its own
        assert garbage() is not None
        collection.collect()
        assert garbage() is None
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_disabled_collector_stays_disabled() -> None:
    gc.disable()
    try:
        with collection.collect_at_pauses():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
