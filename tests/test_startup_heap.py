"""Freezing a serving process's start-up heap (actors/startup_heap.py)."""

import gc
import weakref

from actors.startup_heap import freeze_startup_heap


class _Node:
    pass


def test_startup_objects_leave_collections_and_later_cycles_are_still_freed():
    startup_state = [[] for _ in range(1000)]
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(startup_state)  # passes skip them
        node = _Node()
        node.itself = node  # garbage only a collection finds
        alive = weakref.ref(node)
        del node
        gc.collect()
        assert alive() is None
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
