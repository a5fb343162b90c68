"""Who owns the device memory right now, and the only room that talks to torch_memory_saver,
pinned memory and copy streams.

    from handoff.memory.regions import RegionPool      # tagged regions that sleep and wake
    from handoff.memory.staging import PinnedArena     # pinned host space, async D2H / H2D
    from handoff.memory.meter import MemoryMeter       # probes -> timeline -> PNG
    from handoff.memory.allocator import aggressive_empty_cache, expandable_segments

Files: allocator.py (the caching allocator's knobs, the frozen GC heap, host readings),
regions.py (RegionPool and its CPU backend), tms_backend.py (its CUDA backend),
staging.py (PinnedArena), host_copy.py (copies by kernel, off the copy engines), meter.py.
"""
