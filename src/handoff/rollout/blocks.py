"""Paged KV block manager with a prefix cache keyed by chained block hashes.

The KV pool is `num_blocks` blocks of `block_size` tokens; block 0 is the null block (padding
reads and writes land there) and is never handed out. A sequence owns a block table (its
block ids in order); the manager also keeps every running sequence's table in one int32 array
`tables[row, :]` (padded with 0) so the decode step slices it instead of rebuilding it.

Prefix cache: a full block's hash is xxh64 of its token ids seeded with the previous block's
hash, so equal hashes mean equal whole prefixes; a block keeps its tokens so a collision can
never be served. Freed blocks keep hash and contents and sit in an LRU free list: a later
sequence with the same prefix revives them. A prompt's last token is never served from the
cache (its logits are needed), so lookups stop at the last full block before it. Partial
blocks are never hashed.

Usable blocks: an elastic pool (rollout.kv_pool=elastic) is backed by memory only up to block
`usable`; blocks past it are never handed out. `grow(n)` adds the blocks up to n to the free
list as memory arrives; `reset_usable(n)` starts a wake over n blocks, all free.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

import numpy as np
import xxhash

from handoff.rollout.sequence import Sequence


def block_hash(token_ids: list[int], parent: int) -> int:
    """Chained hash of one full block: covers every token of the prefix through `parent`."""
    return xxhash.xxh64_intdigest(array("q", token_ids).tobytes(), seed=parent)


class BlockManager:
    """Owns block ids, reference counts, the hash index and the block-table rows."""

    def __init__(self, num_blocks: int, block_size: int, *, max_num_seqs: int,
                 max_blocks_per_seq: int, usable: int | None = None):
        self.num_blocks = num_blocks
        self.usable = num_blocks if usable is None else min(usable, num_blocks)
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.hashes = [-1] * num_blocks
        self.tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        # Insertion order is the LRU order: allocate from the front, free to the back.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, self.usable))
        self.hash_to_block: dict[int, int] = {}
        self.tables = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0     # of which served from the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.free if self.hashes[b] != -1)

    def _take_fresh(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.hashes[block]
        if old != -1 and self.hash_to_block.get(old) == block:
            del self.hash_to_block[old]
        self.hashes[block] = -1
        self.tokens[block] = None
        self.ref_count[block] = 1
        return block

    def _register(self, block: int, token_ids: list[int], parent: int) -> int:
        h = block_hash(token_ids, parent)
        self.hashes[block] = h
        self.tokens[block] = tuple(token_ids)
        self.hash_to_block[h] = block
        return h

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached block ids for the longest prefix of `seq`, never covering its last token."""
        bs = self.block_size
        found, parent = [], 0
        for i in range((seq.num_tokens - 1) // bs):
            token_ids = seq.token_ids[i * bs:(i + 1) * bs]
            h = block_hash(token_ids, parent)
            block = self.hash_to_block.get(h)
            if block is None or self.tokens[block] != tuple(token_ids):
                break
            found.append(block)
            parent = h
        return found

    def allocate(self, seq: Sequence) -> bool:
        """Give `seq` blocks for all its tokens, reusing cached ones; False if the pool is short."""
        assert not seq.block_table and seq.row == -1
        bs = self.block_size
        cached = self._cached_prefix(seq)
        num_needed = -(-seq.num_tokens // bs)
        revived = sum(1 for b in cached if self.ref_count[b] == 0)
        if num_needed - len(cached) + revived > len(self.free) or not self.free_rows:
            return False
        for block in cached:
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1
        table = list(cached)
        parent = self.hashes[cached[-1]] if cached else 0
        for i in range(len(cached), num_needed):
            block = self._take_fresh()
            table.append(block)
            if (i + 1) * bs <= seq.num_tokens:
                # Registered before the prefill runs: nothing can read it until that forward
                # has stored every layer's KV (stores precede attention within each layer).
                parent = self._register(block, seq.token_ids[i * bs:(i + 1) * bs], parent)
        seq.block_table = table
        seq.num_cached_tokens = len(cached) * bs
        seq.row = self.free_rows.pop()
        self.tables[seq.row, :len(table)] = table
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_cached_tokens
        return True

    def reserve_decode_slot(self, seq: Sequence, ahead: int = 0) -> bool:
        """Make room for the KV of `seq`'s last token (written by the coming decode step), or
        with ahead=1 of the token the step in flight is sampling (a step staged early).

        Returns False, changing nothing, when a new block is needed and none is free.
        """
        bs = self.block_size
        n = seq.num_tokens + ahead
        table = seq.block_table
        if len(table) * bs < n:
            if not self.free:
                return False
            block = self._take_fresh()
            self.tables[seq.row, len(table)] = block
            table.append(block)
        return True

    def register_filled_block(self, seq: Sequence) -> None:
        """After a step stored the KV of `seq`'s last token: hash the block that store
        filled, so a preempted or later sequence can reuse it. Only now: a hash names KV
        that is in the cache (a step staged early may still be writing the next block)."""
        bs = self.block_size
        n = seq.num_tokens
        if n == 0 or n % bs:
            return
        i = n // bs - 1
        block = seq.block_table[i]
        if self.hashes[block] == -1:  # prompt blocks were hashed when allocated
            parent = self.hashes[seq.block_table[i - 1]] if i > 0 else 0
            self._register(block, seq.token_ids[n - bs:n], parent)

    def free_seq(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks keep their hashes (revivable) until reused."""
        # Deepest blocks go to the free list first so they are evicted before the prefix roots.
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
        self.tables[seq.row, :len(seq.block_table)] = 0
        self.free_rows.append(seq.row)
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.row = -1

    def grow(self, usable: int) -> None:
        """Blocks below `usable` are backed by memory now: the new ones join the free list,
        at its front (never used, so taken before cached blocks are evicted)."""
        usable = min(usable, self.num_blocks)
        for block in range(max(self.usable, 1), usable):
            self.free[block] = None
            self.free.move_to_end(block, last=False)
        self.usable = max(self.usable, usable)

    def reset_usable(self, usable: int) -> None:
        """A fresh mapping of `usable` blocks, every one free, no prefix cached (a wake)."""
        assert len(self.free) == max(self.usable, 1) - 1, "reset_usable with sequences running"
        self.usable = min(usable, self.num_blocks)
        self.free = OrderedDict.fromkeys(range(1, self.usable))
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget every hash (the KV they describe is gone or was computed by old weights)."""
        assert len(self.free) == max(self.usable, 1) - 1, "reset_prefix_cache with sequences running"
        self.hash_to_block.clear()
        self.hashes = [-1] * self.num_blocks
        self.tokens = [None] * self.num_blocks
