"""Who owns the device memory right now: tagged regions, the pinned arena, the meter.

    from handoff.memory import RegionPool, PinnedArena, MemoryMeter
"""

from handoff.memory.meter import MemoryMeter
from handoff.memory.regions import (RegionPool, aggressive_empty_cache, expandable_segments,
                                    frozen_gc_heap, set_expandable_segments)
from handoff.memory.staging import PinnedArena, Transfer

__all__ = ["MemoryMeter", "RegionPool", "PinnedArena", "Transfer", "aggressive_empty_cache",
           "expandable_segments", "frozen_gc_heap", "set_expandable_segments"]
