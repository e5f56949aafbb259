"""process.startup_gc: start-up objects leave the collector's view (a full collection no longer walks them)."""

from __future__ import annotations

import gc
import weakref

from hpc_rl.process.startup_gc import freeze_startup_objects


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_objects_before_the_freeze_are_not_walked_and_later_ones_are() -> None:
    frozen = _cycle()  # garbage made at "start-up": a cycle only the collector could free
    try:
        assert freeze_startup_objects() > 0
        gc.collect()
        assert frozen() is not None  # in the permanent generation: no collection walks it
        later = _cycle()  # made after the freeze: collected as before
        gc.collect()
        assert later() is None
    finally:
        gc.unfreeze()  # the test process goes on as it was
    gc.collect()
    assert frozen() is None
