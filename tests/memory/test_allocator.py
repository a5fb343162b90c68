"""The allocator's knobs and the host readings (handoff.memory.allocator)."""

import gc
import weakref

import pytest

from handoff.memory.allocator import (aggressive_empty_cache, expandable_segments, frozen_gc_heap,
                                      host_memory, rss_bytes, set_expandable_segments)


def test_expandable_segments_switch_and_restore():
    start = set_expandable_segments(True)
    set_expandable_segments(start)   # set_expandable_segments returns the setting it replaced
    with expandable_segments(not start):
        assert set_expandable_segments(not start) is (not start)
    assert set_expandable_segments(start) is start
    aggressive_empty_cache()


def test_host_readings_are_this_machines():
    total, available = host_memory()
    assert total > available > 0
    assert 0 < rss_bytes() < total


def test_frozen_gc_heap_collects_setup_garbage_then_unfreezes_even_on_error():
    class Node:
        pass

    cycle = Node()
    cycle.self = cycle           # garbage only a collection can free
    alive = [Node()]
    gone = weakref.ref(cycle)
    del cycle
    with pytest.raises(RuntimeError):
        with frozen_gc_heap():
            assert gc.get_freeze_count() > 0
            tracked = {id(o) for o in gc.get_objects()}
            assert id(alive) not in tracked and gone() is None
            raise RuntimeError("a step failed")
    assert gc.get_freeze_count() == 0
    assert id(alive) in {id(o) for o in gc.get_objects()}
